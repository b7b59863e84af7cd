"""FP8 KV cache scales on the CPU: from the checkpoint (`self_attn.k_scale` / `v_scale`, vLLM's names; per tensor
or per KV head), or measured at start-up (`calculate_kv_scales`, `executor/kv_scale_calibration.py`).

The model under test is a random tiny Llama whose value projections are
multiplied by 4096: its V values reach the thousands, past e4m3's +-448, so
an fp8 cache with unit scales cannot hold them, and the checkpoint's v_scale
of 64 brings them back into range. Measured (teacher-forced top-1 agreement
with the fp32 cache, 4 prompts x 64 steps, `tests/fp8_agreement.py`): 0.94
with the checkpoint's scales, 0.32 with unit scales; the unscaled model
scores 0.98. Calculated scales: see `test_calculated_scales_keep_an_out_of_range_cache_accurate`.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint, make_deepseek_checkpoint, prompts
from tests.fp8_agreement import KVScaleValues, engine_kv_scales, fp8_kv_agreement
from tests.fp8_checkpoints import rewrite_tensors
from tests.multi_rank_runs import assert_same, engine, run_workloads
from tokenspeed import LLM, SamplingParams
from tokenspeed.errors import InvalidRequest
from tokenspeed.models import ModelConfig, WeightLoadError
from tokenspeed.models.parallel.weight_sharding import (
    WHOLE,
    TensorSlice,
    WeightKind,
    rule_for,
    slice_for_rank,
)
from tokenspeed.placement.parallel_config import ParallelConfig

V_GAIN, V_SCALE = 4096.0, 64.0
STEPS = 64


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("kv_scales") / "base")


def _variant(base: Path, folder: Path, scales: dict[str, torch.Tensor], v_gain: float = V_GAIN) -> Path:
    """`base` with its value projections times `v_gain` and `scales` (by last name) added to every layer."""
    shutil.copytree(base, folder)

    def change(weights: dict[str, torch.Tensor]) -> None:
        layers = sorted({name.split(".")[2] for name in weights if name.startswith("model.layers.")})
        for name in list(weights):
            if name.endswith("self_attn.v_proj.weight"):
                weights[name] = weights[name] * v_gain
        for layer in layers:
            for scale, value in scales.items():
                weights[f"model.layers.{layer}.self_attn.{scale}"] = value.clone()

    rewrite_tensors(folder, change)
    return folder


def _second_head_out_of_range(base: Path, folder: Path, scales: dict[str, torch.Tensor], gain: float = V_GAIN,
                              *, same_model: bool = True) -> Path:
    """`base` (two KV heads, four query heads) with the value rows of its second KV head times `gain`, and
    `scales` added. `same_model`: the o_proj columns of the query heads reading that head divided by `gain`
    too (a power of two: the same model, exactly, whose second head's values pass e4m3's range while the
    first's stay small, so both heads matter); else the second head's values dominate the output."""
    _variant(base, folder, scales, v_gain=1.0)

    def skew(weights: dict[str, torch.Tensor]) -> None:
        for name in [n for n in weights if n.endswith(("self_attn.v_proj.weight", "self_attn.o_proj.weight"))]:
            weight = weights[name].clone()
            if name.endswith("v_proj.weight"):
                weight[weight.shape[0] // 2 :] *= gain
            elif same_model:
                weight[:, weight.shape[1] // 2 :] /= gain
            weights[name] = weight

    rewrite_tensors(folder, skew)
    return folder


def test_checkpoint_scales_keep_an_out_of_range_cache_accurate(base: Path, tmp_path: Path) -> None:
    scaled = _variant(base, tmp_path / "scaled", {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(V_SCALE)})
    unit = _variant(base, tmp_path / "unit", {})
    batch = prompts(4, seed=9, min_len=8, max_len=32)
    with_scales, without = fp8_kv_agreement(scaled, batch, STEPS), fp8_kv_agreement(unit, batch, STEPS)
    assert with_scales >= 0.9, f"top-1 agreement with the checkpoint's scales {with_scales:.4f}"
    assert without < 0.5, f"these values are out of e4m3 range at unit scales: agreement {without:.4f}"


def test_scales_reach_every_layer_and_a_bf16_cache_ignores_them(base: Path, tmp_path: Path) -> None:
    scaled = _variant(base, tmp_path / "scaled", {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor(2.0)},
                      v_gain=1.0)
    fp8 = LLM(str(scaled), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")
    assert set(engine_kv_scales(fp8)) == {((0.5, 0.5), (2.0, 2.0))}  # one for both KV heads
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=3, min_len=6, max_len=12)]
    with_scales = LLM(str(scaled), skip_tokenizer_init=True, show_progress=False).generate(batch, greedy)
    plain = LLM(str(base), skip_tokenizer_init=True, show_progress=False).generate(batch, greedy)
    assert [o.outputs[0].token_ids for o in with_scales] == [o.outputs[0].token_ids for o in plain]


def test_one_kv_scale_sets_both(base: Path, tmp_path: Path) -> None:
    folder = _variant(base, tmp_path / "legacy", {"kv_scale": torch.tensor(0.25)}, v_gain=1.0)
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")
    assert set(engine_kv_scales(llm)) == {((0.25, 0.25), (0.25, 0.25))}


@pytest.mark.parametrize(("value", "message"), [(torch.ones(3), r"one element, or one per KV head \(2\)"),
                                                (torch.tensor(0.0), "positive"), (torch.tensor(float("inf")), "positive"),
                                                (torch.tensor([1.0, 0.0]), "per-head scale must be positive")])
def test_malformed_scales_are_clear_weight_load_errors(base: Path, tmp_path: Path, value: torch.Tensor,
                                                       message: str) -> None:
    folder = _variant(base, tmp_path / "bad", {"k_scale": value, "v_scale": torch.tensor(1.0)}, v_gain=1.0)
    with pytest.raises(WeightLoadError, match=rf"self_attn\.k_scale: .*{message}"):
        LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")


def test_a_scale_without_an_attention_layer_is_still_unexpected(base: Path, tmp_path: Path) -> None:
    folder = _variant(base, tmp_path / "stray", {}, v_gain=1.0)
    rewrite_tensors(folder, lambda weights: weights.update({"model.layers.0.mlp.k_scale": torch.tensor(1.0)}))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: model\.layers\.0\.mlp\.k_scale"):
        LLM(str(folder), skip_tokenizer_init=True, show_progress=False)


def test_scales_are_whole_on_every_rank_or_split_by_kv_head(base: Path) -> None:
    """A per-tensor scale (0-d or one element) is every rank's; a per-head one splits as the KV heads do."""
    config = ModelConfig.from_pretrained(base)
    topology = ParallelConfig(tensor_parallel_size=2).topology()
    for scale in ("k_scale", "v_scale", "kv_scale"):
        name = f"model.layers.0.self_attn.{scale}"
        rule = rule_for(name, config, topology)
        assert rule.kind == WeightKind.KV_HEADS
        for rank in (0, 1):
            assert slice_for_rank(name, rule, (), topology, rank) == slice_for_rank(name, rule, (1,), topology, rank)
            assert slice_for_rank(name, rule, (), topology, rank) == WHOLE
            assert slice_for_rank(name, rule, (2,), topology, rank) == TensorSlice(0, rank, rank + 1)


# --- per-head scales (llm-compressor's attn_head strategy) ------------------------------------------------

HEAD_GAIN, HEAD_SCALE = 2.0**16, 1024.0  # the second head's values in the tens of thousands


def test_per_head_scales_keep_both_heads_accurate(base: Path, tmp_path: Path) -> None:
    """One head's values pass e4m3's range by 2^16 and the other's are small: per-head scales keep both
    (agreement 0.984, the unscaled model's), where one scale for both flushes the small head's values (0.656)
    and unit scales saturate the large head's (0.301). A per-tensor k_scale beside them fills both heads,
    and a per-head kv_scale sets both."""
    batch = prompts(4, seed=9, min_len=8, max_len=32)
    per_head = _second_head_out_of_range(base, tmp_path / "per_head", {"k_scale": torch.tensor(1.0),
                                                                       "v_scale": torch.tensor([1.0, HEAD_SCALE])},
                                         gain=HEAD_GAIN)
    per_tensor = _second_head_out_of_range(base, tmp_path / "per_tensor", {"k_scale": torch.tensor(1.0),
                                                                           "v_scale": torch.tensor(HEAD_SCALE)},
                                           gain=HEAD_GAIN)
    assert fp8_kv_agreement(per_head, batch, STEPS) >= 0.95
    assert fp8_kv_agreement(per_tensor, batch, STEPS) < 0.8
    llm = LLM(str(per_head), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")
    assert set(engine_kv_scales(llm)) == {((1.0, 1.0), (1.0, HEAD_SCALE))}
    legacy = _variant(base, tmp_path / "legacy", {"kv_scale": torch.tensor([0.5, 2.0])}, v_gain=1.0)
    llm = LLM(str(legacy), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")
    assert set(engine_kv_scales(llm)) == {((0.5, 2.0), (0.5, 2.0))}


def test_per_head_scales_on_two_ranks_match_one(base: Path, tmp_path: Path) -> None:
    """Each rank reads the scale of its own KV head (rank 0 the small head's): two ranks give one rank's
    tokens and log-probabilities."""
    folder = _second_head_out_of_range(base, tmp_path / "per_head", {"k_scale": torch.tensor(1.0),
                                                                     "v_scale": torch.tensor([1.0, HEAD_SCALE])},
                                       gain=HEAD_GAIN)
    results, scales = {}, {}
    for tp in (1, 2):
        llm = engine(folder, tp, False, kv_cache_dtype="fp8")
        try:
            results[tp] = run_workloads(llm)
            scales[tp] = engine_kv_scales(llm)
        finally:
            llm.shutdown()
    assert set(scales[1]) == {((1.0, 1.0), (1.0, HEAD_SCALE))}
    assert set(scales[2]) == {((1.0,), (1.0,))}  # rank 0: the first head
    assert_same("llama", results[1], results[2])


def test_checkpoint_scales_on_two_ranks_match_one(base: Path, tmp_path: Path) -> None:
    """Each rank reads the replicated scales for its heads: two ranks give one rank's tokens and
    log-probabilities, through prefix hits, chunked prefill and preemption (ranks that dropped the
    scales could not hold these values, as the unit-scale run above shows)."""
    folder = _variant(base, tmp_path / "scaled", {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(V_SCALE)})
    results = {}
    for tp in (1, 2):
        llm = engine(folder, tp, False, kv_cache_dtype="fp8")
        try:
            results[tp] = run_workloads(llm)
        finally:
            llm.shutdown()
    assert_same("llama", results[1], results[2])


# --- scales measured at start-up (calculate_kv_scales) ----------------------------------------------------


def _calculated(folder: Path, **options: object) -> list[KVScaleValues]:
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8",
              calculate_kv_scales=True, **options)  # type: ignore[arg-type]
    try:
        return engine_kv_scales(llm)
    finally:
        llm.shutdown()


def _powers_of_two(scales: list[KVScaleValues]) -> bool:
    return all(x > 0 and math.frexp(x)[0] == 0.5 for k, v in scales for x in (*k, *v))


def test_calculated_scales_keep_an_out_of_range_cache_accurate(base: Path, tmp_path: Path) -> None:
    """Without scales in the checkpoint, the ones measured on random tokens, per KV head, powers of two,
    bring V's thousands back into e4m3's range: agreement with the fp32 cache >= 0.9 (0.94 with the
    checkpoint's calibrated scales, 0.32 with unit scales). Where only the second head's values pass the
    range (by 2^16), its own scale keeps the first head's small values exact enough: 0.984, where one scale
    for both heads gives 0.656 (`test_per_head_scales_keep_both_heads_accurate`)."""
    batch = prompts(4, seed=9, min_len=8, max_len=32)
    unit = _variant(base, tmp_path / "unit", {})
    scales = _calculated(unit)
    assert _powers_of_two(scales) and all(min(v) >= 4.0 for _, v in scales), scales  # V peaks of ~1000 or more
    agreement = fp8_kv_agreement(unit, batch, STEPS, kv_scales=scales)
    assert agreement >= 0.9, f"top-1 agreement with calculated scales {agreement:.4f}"
    skewed = _second_head_out_of_range(base, tmp_path / "skewed", {}, gain=HEAD_GAIN)
    scales = _calculated(skewed)
    assert all(v[1] >= 256 * v[0] for _, v in scales), scales
    agreement = fp8_kv_agreement(skewed, batch, STEPS, kv_scales=scales)
    assert agreement >= 0.95, f"top-1 agreement with calculated per-head scales {agreement:.4f}"


def test_calculated_scales_replace_the_checkpoint_s(base: Path, tmp_path: Path) -> None:
    """Asked for, measured scales win over a checkpoint's (the same weights give the same scales with and
    without them), and a bf16 cache cannot ask for them."""
    with_scales = _variant(base, tmp_path / "scaled", {"k_scale": torch.tensor(0.5), "v_scale": torch.tensor(8.0)})
    without = _variant(base, tmp_path / "unit", {})
    measured = _calculated(without)
    assert _calculated(with_scales) == measured and all(0.5 not in k and 8.0 not in v for k, v in measured)
    with pytest.raises(InvalidRequest, match="kv_cache_dtype"):
        LLM(str(without), skip_tokenizer_init=True, show_progress=False, calculate_kv_scales=True)


def test_calculate_kv_scales_flag() -> None:
    """vLLM's flag: `--calculate-kv-scales` with `--kv-cache-dtype fp8`; alone, or with DP attention, a clear
    error before anything loads."""
    import argparse

    from tokenspeed.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"]))
    config.validate()
    assert config.calculate_kv_scales and not engine_config_from_args(parser.parse_args([])).calculate_kv_scales
    with pytest.raises(InvalidRequest, match="set kv_cache_dtype to fp8"):
        engine_config_from_args(parser.parse_args(["--calculate-kv-scales"])).validate()
    with pytest.raises(InvalidRequest, match="enable_dp_attention"):
        config.replace(tensor_parallel_size=2, enable_dp_attention=True).validate()


def test_calculated_scales_on_two_ranks_match_one(base: Path, tmp_path: Path) -> None:
    """Only the second KV head's values pass e4m3's range, and on two ranks only rank 1 stores that head:
    each rank measures its own head as one rank measures it (rank 0 the small one), and two ranks give one
    rank's tokens and log-probabilities."""
    folder = _second_head_out_of_range(base, tmp_path / "skewed", {}, same_model=False)
    results, scales = {}, {}
    for tp in (1, 2):
        llm = engine(folder, tp, False, kv_cache_dtype="fp8", calculate_kv_scales=True)
        try:
            results[tp] = run_workloads(llm)
            scales[tp] = engine_kv_scales(llm)
        finally:
            llm.shutdown()
    assert all(v[1] >= 4.0 > v[0] for _, v in scales[1]), scales[1]
    assert scales[2] == [((k[0],), (v[0],)) for k, v in scales[1]]  # rank 0: the first head's
    assert_same("llama", results[1], results[2])


def test_calculated_scale_of_an_mla_latent_cache(tmp_path: Path) -> None:
    """MLA stores one latent row (normalised latent, rotated k_pe) under one scale (`k_scale`): it is
    measured, V's is never used and stays 1.0, and the engine decodes with it."""
    folder = make_deepseek_checkpoint("deepseek_v3", tmp_path / "mla")
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    scales = engine_kv_scales(llm)
    assert _powers_of_two(scales) and all(k != (1.0,) and v == (1.0,) for k, v in scales), scales
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(2, seed=4, min_len=6, max_len=12)], greedy)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
