"""Calibrated KV cache scales from the checkpoint (`self_attn.k_scale` / `v_scale`, vLLM's names) on the CPU.

The model under test is a random tiny Llama whose value projections are
multiplied by 4096: its V values reach the thousands, past e4m3's +-448, so
an fp8 cache with unit scales cannot hold them, and the checkpoint's v_scale
of 64 brings them back into range. Measured (teacher-forced top-1 agreement
with the fp32 cache, 4 prompts x 64 steps, `tests/fp8_agreement.py`): 0.94
with the checkpoint's scales, 0.32 with unit scales; the unscaled model
scores 0.98.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint, prompts
from tests.fp8_agreement import fp8_kv_agreement
from tests.fp8_checkpoints import rewrite_tensors
from tests.multi_rank_runs import assert_same, engine, run_workloads
from tokenspeed import LLM, SamplingParams
from tokenspeed.models import ModelConfig, WeightLoadError
from tokenspeed.models.parallel.weight_sharding import WeightKind, rule_for
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


def _attention_scales(llm: LLM) -> list[tuple[float, float]]:
    model = llm.core.executor.model  # type: ignore[attr-defined]
    return [(layer.self_attn.kv_scales.k_scale.item(), layer.self_attn.kv_scales.v_scale.item())
            for layer in model.model.layers]


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
    assert set(_attention_scales(fp8)) == {(0.5, 2.0)}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=3, min_len=6, max_len=12)]
    with_scales = LLM(str(scaled), skip_tokenizer_init=True, show_progress=False).generate(batch, greedy)
    plain = LLM(str(base), skip_tokenizer_init=True, show_progress=False).generate(batch, greedy)
    assert [o.outputs[0].token_ids for o in with_scales] == [o.outputs[0].token_ids for o in plain]


def test_one_kv_scale_sets_both(base: Path, tmp_path: Path) -> None:
    folder = _variant(base, tmp_path / "legacy", {"kv_scale": torch.tensor(0.25)}, v_gain=1.0)
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8")
    assert set(_attention_scales(llm)) == {(0.25, 0.25)}


@pytest.mark.parametrize(("value", "message"), [(torch.ones(2), "one element"), (torch.tensor(0.0), "positive"),
                                                (torch.tensor(float("inf")), "positive")])
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


def test_scales_are_replicated_over_attention_ranks(base: Path) -> None:
    config = ModelConfig.from_pretrained(base)
    topology = ParallelConfig(tensor_parallel_size=2).topology()
    for scale in ("k_scale", "v_scale", "kv_scale"):
        assert rule_for(f"model.layers.0.self_attn.{scale}", config, topology).kind == WeightKind.REPLICATED


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
