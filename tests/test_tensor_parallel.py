"""Multi-rank execution on the CPU (gloo, 2 ranks, fp32): every family at TP=2 against TP=1.

For each family one TP=1 and one TP=2 engine run the same two workloads
(`tests/multi_rank_runs.py`: log-probabilities of every position within
1e-5, greedy tokens identical through prefix-cache hits, chunked prefill
and preemption).

MoE families run with expert parallelism (EP=2) where marked, the others with
their experts split by intermediate size; DeepSeek runs MLA with its heads
split over the ranks. Then: a killed worker gives `EngineDead` within 10 s
and leaves no process; bad combinations are refused before any process
starts; each rank reads exactly its share of the checkpoint.

An fp8 KV cache (`kv_cache_dtype="fp8"`) on two ranks against one, for a GQA, a one-kv-head, an MoE
and an MLA family (and MLA under DP attention), on the same workloads.

DP attention (`enable_dp_attention`, 2 attention ranks): DeepSeek-V3 (EP=2),
DeepSeek-V2 and Qwen3-MoE (GQA, EP=2) against TP=1 on the same workloads, plus a lone request (one
rank idle for whole steps) and the placement checked from rank 0's runner:
a prefix-cache hit lands on the rank that wrote the prefix.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.checkpoints import make_checkpoint, make_deepseek_checkpoint, prompts
from tests.multi_rank_runs import assert_same, engine, positions, run_workloads
from tokenspeed import LLM, SamplingParams
from tokenspeed.config import EngineConfig
from tokenspeed.errors import EngineDead, InvalidRequest, TokenSpeedError
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.loader import find_weight_files
from tokenspeed.models.parallel.weight_sharding import rule_for

# family -> expert parallel at TP=2
FAMILIES = {
    "llama": False,
    "qwen2": False,  # one kv head: replicated on both ranks; q/k/v bias
    "qwen3": False,
    "mistral": False,
    "qwen3_moe": True,
    "mixtral": False,
    "deepseek_v3": True,
    "deepseek_v2_greedy": False,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    made = {}
    for family in FAMILIES:
        make = make_deepseek_checkpoint if family.startswith("deepseek") else make_checkpoint
        made[family] = make(family, root / family)
    return made


def _checkpoint_share(folder: Path, llm: LLM) -> None:
    """Each rank read 1/N of every sharded tensor's bytes and every replicated tensor whole, measured."""
    config = ModelConfig.from_pretrained(folder)
    topology = llm.core.config.parallel_config().topology()
    sharded = replicated = 0
    for path in find_weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in list(f.keys()):  # a safe_open handle is not iterable
                nbytes = 4 * math.prod(f.get_slice(name).get_shape())
                if rule_for(name, config, topology).sharded:
                    sharded += nbytes
                else:
                    replicated += nbytes
    stats = llm.core.executor.read_stats  # type: ignore[attr-defined]
    assert len(stats) == topology.world_size
    for share in stats:
        assert (share.sharded_bytes, share.replicated_bytes) == (sharded // topology.world_size, replicated)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_match_one(folders, family):
    ep = FAMILIES[family]
    results = {}
    for tp in (1, 2):
        llm = engine(folders[family], tp, ep)
        try:
            results[tp] = run_workloads(llm)
            if tp > 1 and family in ("qwen3_moe", "llama"):  # EP experts; a tied vocab-parallel head
                _checkpoint_share(folders[family], llm)
        finally:
            llm.shutdown()
    assert_same(family, results[1], results[2])


@pytest.mark.parametrize(("family", "dp_attention"), [("llama", False), ("qwen2", False), ("qwen3_moe", False),
                                                      ("deepseek_v3", False), ("deepseek_v3", True)])
def test_fp8_kv_cache_on_two_ranks_matches_one(folders, family, dp_attention):
    """An e4m3 KV cache split over two ranks (each rank stores its own heads, or MLA's whole latent,
    in fp8) gives what one rank's fp8 cache gives, through the same prefix hits, chunked prefill and
    preemption; and the fp8 cache is really in use on the ranks: the log-probabilities move away
    from the fp32 cache's."""
    ep = FAMILIES[family]
    results = {}
    for tp, kv_cache_dtype in ((1, "fp8"), (2, "fp8"), (2, "auto")):
        llm = engine(folders[family], tp, ep, dp_attention, kv_cache_dtype=kv_cache_dtype)
        try:
            results[tp, kv_cache_dtype] = run_workloads(llm)
        finally:
            llm.shutdown()
    assert_same(family, results[1, "fp8"], results[2, "fp8"])
    fp8, full = (positions(results[2, kind]["sync"][0]) for kind in ("fp8", "auto"))  # type: ignore[index]
    assert max(abs(lp - b[t]) for a, b in zip(fp8, full) for t, lp in a.items() if t in b) > 1e-3


def _lone_request(llm: LLM) -> list[int]:
    """One request alone: under DP attention the other rank has no rows for every step of it."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompts(1, seed=31, min_len=50, max_len=60)[0]}], params,
                          use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2_greedy", "qwen3_moe"])
def test_dp_attention_matches_one_rank(folders, family):
    """DP attention 2 (V3 and Qwen3-MoE with their experts over EP=2; Qwen3-MoE is GQA) vs TP=1: same
    greedy tokens, logprobs within 1e-5, through prefix hits, chunked prefill, a preemption and steps
    where one rank holds no request."""
    ep = FAMILIES[family]
    results, lone = {}, {}
    for tp in (1, 2):
        llm = engine(folders[family], tp, ep, dp_attention=True)
        try:
            results[tp] = run_workloads(llm)
            lone[tp] = _lone_request(llm)
            if tp > 1:
                runner = llm.core.executor.local.runner  # type: ignore[attr-defined]
                placement = runner.attention_ranks
                assert placement is not None and placement.steps_with_idle_rank >= 5
                assert min(placement.placements) >= 3, placement.placements  # both ranks held requests
                assert runner.graphs is None
        finally:
            llm.shutdown()
    assert_same(family, results[1], results[2])
    assert lone[1] == lone[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_worker_gives_engine_dead_within_10_s_and_no_process_is_left(folders):
    llm = engine(folders["llama"], 2, False)
    executor = llm.core.executor
    pids = executor.worker_pids  # type: ignore[attr-defined]
    assert pids and all(_alive(pid) for pid in pids)
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pids[0], 9)

    killer = threading.Thread(target=kill)
    killer.start()
    batch = prompts(4, seed=11, min_len=20, max_len=40)
    try:
        with pytest.raises(EngineDead):
            for _ in range(200):  # keeps generating until the kill lands
                llm.generate([{"prompt_token_ids": p} for p in batch],
                             SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True), use_tqdm=False)
        raised_at = time.monotonic()
    finally:
        killer.join()
        llm.shutdown()
    assert raised_at - killed_at[0] < 10.0
    assert not any(_alive(pid) for pid in pids)


def test_a_hung_worker_gives_engine_dead_after_the_collective_timeout(folders, monkeypatch):
    """A rank that stops answering (SIGSTOP: alive, silent) fails its peers' next collective after the
    timeout (3 s here, 10 s by default on the CPU); shutdown then ends the stopped process too."""
    monkeypatch.setenv("TOKENSPEED_RANK_TIMEOUT_S", "3")
    llm = engine(folders["llama"], 2, False)
    pid = llm.core.executor.worker_pids[0]  # type: ignore[attr-defined]
    batch = prompts(2, seed=12, min_len=10, max_len=20)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(EngineDead):
            llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        assert time.monotonic() - stopped_at < 10.0
    finally:
        llm.shutdown()
    assert not _alive(pid)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(tensor_parallel_size=3), "does not divide the 4 attention heads"),
        (dict(tensor_parallel_size=2, enable_dp_attention=True), "tied word embeddings"),
        (dict(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "one rank only"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=2, enable_expert_parallel=True), "expert parallelism needs a mixture-of-experts"),
    ],
)
def test_bad_combinations_are_refused_before_any_rank_starts(folders, changes, message):
    with pytest.raises((InvalidRequest, TokenSpeedError)) as error:
        LLM(str(folders["llama"]), skip_tokenizer_init=True, show_progress=False, device="cpu", **changes)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "single_rank_option",
    [
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        dict(host_kv_cache_bytes=1 << 20),
    ],
    ids=["speculative_config", "host_kv_cache_bytes"],
)
def test_single_rank_features_with_several_ranks_are_refused_by_the_config(single_rank_option):
    with pytest.raises(InvalidRequest, match="one rank only"):
        EngineConfig(tensor_parallel_size=2, **single_rank_option).validate()
    EngineConfig(tensor_parallel_size=1, **single_rank_option).validate()


def test_cli_flags_carry_vllm_names_into_the_engine_config():
    import argparse

    from tokenspeed.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "--enable-expert-parallel"]))
    assert (config.tensor_parallel_size, config.enable_expert_parallel, config.enable_dp_attention) == (2, True, False)
    config = engine_config_from_args(parser.parse_args(["--tensor-parallel-size", "4", "--enable-dp-attention"]))
    assert config.parallel_config().topology().attn_dp == 4
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    config.validate()  # FP8 weights and cache combine with several ranks
    assert (config.tensor_parallel_size, config.quantization, config.kv_cache_dtype) == (2, "fp8", "fp8")


def test_the_plan_executor_at_world_size_one_is_the_family_forward(folders):
    """At one rank the compiled plan has no collective and `PlannedModel` runs the family's modules in the
    plan's order: same tokens and logprobs as the family's own forward (no process spawned)."""
    from tokenspeed.models.parallel.planned_model import PlannedModel
    from tokenspeed.placement.compiler import compile_plan
    from tokenspeed.placement.model_graph import describe_model
    from tokenspeed.placement.parallel_config import ParallelConfig
    from tokenspeed.placement.process_groups import create_parallel_groups

    folder = folders["deepseek_v3"]
    batch = prompts(3, seed=21, min_len=5, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outputs = []
    for planned in (False, True):
        llm = engine(folder, 1, False)
        try:
            if planned:
                executor = llm.core.executor
                config = ModelConfig.from_pretrained(folder)
                topology = ParallelConfig().validate_for_model(config)
                plan = compile_plan(describe_model(config), topology, dtype_bytes=4)
                assert not plan.collectives()
                model = PlannedModel(executor.model, plan, create_parallel_groups(topology, 0))  # type: ignore[attr-defined]
                executor.runner.model = model  # type: ignore[attr-defined]
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            outputs.append([(o.outputs[0].token_ids, positions(o)) for o in outs])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


def test_dp_attention_needs_one_rank_per_attention_group(folders):
    """`EngineConfig` always asks for one group per rank; a topology with 2-rank attention groups is refused."""
    from tokenspeed.executor.multi_rank import check_dp_attention
    from tokenspeed.placement.parallel_config import ParallelConfig, ParallelConfigError

    config = ModelConfig.from_pretrained(folders["deepseek_v3"])
    topology = ParallelConfig(tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=2).topology()
    with pytest.raises(ParallelConfigError, match="one rank per attention group"):
        check_dp_attention(config, topology)
    check_dp_attention(config, ParallelConfig(tensor_parallel_size=2, enable_dp_attention=True,
                                              data_parallel_size=2).topology())
