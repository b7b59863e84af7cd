"""`ParallelConfig` refuses bad combinations with a clear message; `Topology` partitions the world."""

from __future__ import annotations

import pytest

from tokenspeed.errors import TokenSpeedError
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.presets import load_preset, preset_dict
from tokenspeed.placement.parallel_config import ParallelConfig, ParallelConfigError
from tokenspeed.placement.placements import ParallelGroup


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be an integer >= 1"),
        ({"data_parallel_size": 2}, "needs enable_dp_attention"),
        ({"tensor_parallel_size": 4, "enable_dp_attention": True}, "needs data_parallel_size > 1"),
        ({"tensor_parallel_size": 4, "enable_dp_attention": True, "data_parallel_size": 3}, "does not divide"),
        ({"tensor_parallel_size": 4, "expert_parallel_size": 2}, "enable_expert_parallel is not"),
        ({"tensor_parallel_size": 4, "enable_expert_parallel": True, "expert_parallel_size": 3}, "does not divide"),
        ({"all2all_backend": "nccl"}, "all2all_backend must be one of"),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True, "all2all_backend": "alltoall"},
         "needs enable_dp_attention"),
    ],
)
def test_bad_option_combinations_are_refused(options: dict[str, object], message: str):
    with pytest.raises(ParallelConfigError, match=message) as info:
        ParallelConfig(**options)  # type: ignore[arg-type]
    assert isinstance(info.value, TokenSpeedError) and info.value.http_status == 400


def test_every_problem_with_the_model_is_named_at_once():
    llama = load_preset("llama-3.1-8b")  # 32 heads, 8 kv heads, vocab 128256, intermediate 14336
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(tensor_parallel_size=6).validate_for_model(llama)
    text = str(info.value)
    assert text.startswith("LlamaForCausalLM cannot run with tensor_parallel_size=6: ")
    for part in ("ATTN_TP=6 does not divide the 32 attention heads",
                 "ATTN_TP=6 does not divide the 8 kv heads",
                 "DENSE_TP=6 does not divide the 14336 intermediate size"):
        assert part in text
    with pytest.raises(ParallelConfigError, match="ATTN_TP=12 exceeds the 8 kv heads but is not a multiple"):
        ParallelConfig(tensor_parallel_size=12).validate_for_model(llama)
    with pytest.raises(ParallelConfigError, match="expert parallelism needs a mixture-of-experts model"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).validate_for_model(llama)


def test_more_ranks_than_kv_heads_replicates_them():
    qwen3_moe = load_preset("qwen3-30b-a3b")  # 4 kv heads, 128 experts of 768
    topology = ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True).validate_for_model(qwen3_moe)
    assert (topology.attn_tp, topology.moe_ep, topology.moe_tp) == (8, 8, 1)
    odd = ModelConfig.from_dict({**preset_dict("qwen3-30b-a3b"), "num_experts": 6, "moe_intermediate_size": 30})
    with pytest.raises(ParallelConfigError, match="EP=4 does not divide the 6 routed experts"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).validate_for_model(odd)
    with pytest.raises(ParallelConfigError, match="MoE TP=4 does not divide the 30 intermediate size"):
        ParallelConfig(tensor_parallel_size=4).validate_for_model(odd)


def test_mla_needs_heads_divisible_but_has_no_kv_heads_to_split():
    lite = load_preset("deepseek-v2-lite")  # 16 heads, 64 experts, 2 shared experts of 1408
    ParallelConfig(tensor_parallel_size=16, enable_expert_parallel=True).validate_for_model(lite)
    with pytest.raises(ParallelConfigError, match="EP=32 does not divide the 64 routed experts|ATTN_TP=32"):
        ParallelConfig(tensor_parallel_size=32, enable_expert_parallel=True).validate_for_model(lite)


def test_more_ranks_than_devices_is_refused_on_gpus_only():
    parallel = ParallelConfig(tensor_parallel_size=8)
    with pytest.raises(ParallelConfigError, match="needs 8 cuda devices, 1 available"):
        parallel.check_devices(1, "cuda")
    parallel.check_devices(8, "cuda")
    parallel.check_devices(1, "cpu")


def test_topology_partitions_the_world_consistently():
    topology = ParallelConfig(
        tensor_parallel_size=8, enable_dp_attention=True, data_parallel_size=2, enable_expert_parallel=True,
        expert_parallel_size=4,
    ).topology()
    assert (topology.attn_tp, topology.attn_dp, topology.moe_ep, topology.moe_tp) == (4, 2, 4, 2)
    for kind in ParallelGroup:
        groups = topology.group_ranks(kind)
        assert sorted(r for g in groups for r in g) == list(range(8))  # a partition of the world
        assert all(len(g) == topology.size(kind) for g in groups)
        for group in groups:
            assert [topology.coordinate(kind, r) for r in group] == list(range(len(group)))
    assert topology.group_ranks(ParallelGroup.ATTN_TP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.group_ranks(ParallelGroup.ATTN_DP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [topology.ep_index(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topology.axes_of(ParallelGroup.MOE_TP_EP) == ("dp", "tp")
    assert ParallelConfig(tensor_parallel_size=2).topology().axes_of(ParallelGroup.ATTN_DP) == ()
