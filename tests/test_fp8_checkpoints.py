"""Block-FP8 checkpoints (DeepSeek-V3's format, also under Kimi-K2's config header) and online FP8
quantisation, against transformers (CPU).

Each tiny checkpoint is quantised by the test (`tests/fp8_checkpoints.py`)
and transformers runs the dequantised weights in fp32; the engine loads the
fp8 weights and their `weight_scale_inv` as they are and runs them through
`gemm.fp8` / `moe.experts_fp8` (the references on the CPU dequantise on the
fly), so greedy tokens must be identical and logprobs close. Blocks (16, 128)
keep the fused q/k/v and gate/up parts on block rows (scales stored per
block); DeepSeek-V3's (128, 128) blocks do not fit the tiny fused MLA
projection (24 + 40 rows), which exercises the per-row scale layout, and its
`kv_b_proj` is dequantised at load for the absorbed attention. DeepSeek-V3's
MTP layer in fp8 drafts for speculative decoding: same tokens as without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoints import load_hf, prompts
from tests.fp8_checkpoints import (
    _is_projection,
    assert_matches_transformers,
    dequantised_checkpoint,
    fp8_parameters,
    make_source,
    rewrite_tensors,
    to_block_fp8,
)
from tests.test_mla_layer import _with_mtp_layer
from tokenspeed import LLM, SamplingParams
from tokenspeed.errors import InvalidRequest, ModelNotSupported
from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK, dequantize_weight, quantize_weight_block
from tokenspeed.models import WeightLoadError

# (family, block, modules_to_not_convert)
CASES: dict[str, tuple[str, tuple[int, int], tuple[str, ...]]] = {
    "llama": ("llama", (16, 128), ()),
    "llama_not_convert": ("llama", (16, 128), ("model.layers.0.self_attn", "mlp.down_proj")),
    "qwen3_moe": ("qwen3_moe", (16, 128), ()),
    "deepseek_v3": ("deepseek_v3", (128, 128), ()),
    "deepseek_v3_not_convert": ("deepseek_v3", (128, 128), ("shared_experts", "model.layers.0.mlp")),
    "kimi_k2": ("deepseek_v3", (128, 128), ()),  # DeepSeek-V3's weights under Kimi-K2's config.json header
}
# What Kimi-K2's config.json says of itself: its own model_type, DeepSeek-V3's architecture, remote code.
KIMI_K2_HEADER = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_sources")
    return {family: make_source(family, root / family) for family in ("llama", "qwen3_moe", "deepseek_v3")}


def _fp8_pair(sources: dict[str, Path], case: str, root: Path) -> tuple[Path, Path]:
    family, block, not_convert = CASES[case]
    fp8 = root / f"{case}_fp8"
    dequantised = to_block_fp8(sources[family], fp8, block=block, not_convert=not_convert)
    return fp8, dequantised_checkpoint(sources[family], dequantised, root / f"{case}_reference")


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_fp8_checkpoint_matches_transformers(
    case: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    fp8, reference = _fp8_pair(sources, case, tmp_path)
    if case == "kimi_k2":
        config = json.loads((fp8 / "config.json").read_text())
        (fp8 / "config.json").write_text(json.dumps(config | KIMI_K2_HEADER))
    llm = LLM(str(fp8), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=24, show_progress=False)
    quantised = fp8_parameters(llm)
    assert quantised, "no fp8 weights were loaded"
    assert not any("kv_b_proj" in name for name in quantised), "kv_b_proj must be dequantised for absorption"
    for entry in CASES[case][2]:
        assert not any(entry.replace("mlp.down_proj", "down_proj") in name for name in quantised), entry
    assert_matches_transformers(llm, load_hf(reference), case)


def _online_reference(source: Path, folder: Path) -> Path:
    weights = {}
    for path in source.glob("*.safetensors"):
        for name, tensor in load_file(str(path)).items():
            if _is_projection(name) and "kv_b_proj" not in name:
                q, scale = quantize_weight_block(tensor.float(), PER_CHANNEL_BLOCK)
                weights[name] = dequantize_weight(q, scale, PER_CHANNEL_BLOCK)
    return dequantised_checkpoint(source, weights, folder)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_online_fp8_matches_transformers_on_quantised_weights(
    family: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    llm = LLM(str(sources[family]), skip_tokenizer_init=True, page_size=4, quantization="fp8", show_progress=False)
    assert fp8_parameters(llm)
    assert_matches_transformers(llm, load_hf(_online_reference(sources[family], tmp_path / "reference")), family)


@pytest.mark.parametrize("quantization", ["checkpoint", "online"])
def test_mtp_speculation_on_fp8_weights_gives_the_tokens_without_it(
    quantization: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """DeepSeek-V3 with its MTP layer (fp8 like the decoder layers in V3's checkpoint, `eh_proj` bf16) drafts
    with fp8 weights; greedy tokens equal those without speculation."""
    folder = tmp_path / "mtp"
    _with_mtp_layer(sources["deepseek_v3"], folder)
    options: dict[str, Any] = {"quantization": "fp8"}
    if quantization == "checkpoint":
        to_block_fp8(folder, tmp_path / "mtp_fp8", block=(128, 128))
        folder, options = tmp_path / "mtp_fp8", {}
    batch = [{"prompt_token_ids": p} for p in prompts(3, seed=7, min_len=8, max_len=24)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        llm = LLM(str(folder), skip_tokenizer_init=True, page_size=4, show_progress=False, speculative_config=spec,
                  **options)
        tokens[spec is None] = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        if spec is not None:
            mtp_fp8 = [name for name in fp8_parameters(llm) if ".layers.2." in name]  # the MTP layer after the two
            assert mtp_fp8 and not any("eh_proj" in name for name in mtp_fp8), mtp_fp8
            stats = llm.core.speculation_stats  # type: ignore[attr-defined]
            assert stats is not None and stats.num_drafts > 0
        llm.shutdown()
    assert tokens[False] == tokens[True]


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("malformed_plain", lambda t: t.update({
            "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(3, 1)}),
         "o_proj.weight_scale_inv: checkpoint shape (3, 1)"),
        ("malformed_fused", lambda t: t.update({
            "model.layers.1.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2)}),
         "weight_scale_inv of a 64x64 weight in 16x128 blocks must have shape (4, 1)"),
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"),
         "missing tensors: model.layers.1.mlp.up_proj.weight_scale_inv"),
        ("not_fp8", lambda t: t.update({
            "model.layers.0.mlp.gate_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16)}),
         "checkpoint dtype torch.bfloat16 for a torch.float8_e4m3fn parameter"),
    ],
)
def test_bad_scales_are_clear_weight_load_errors(
    name: str, change: Any, message: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    fp8, _ = _fp8_pair(sources, "llama", tmp_path)
    rewrite_tensors(fp8, change)
    with pytest.raises(WeightLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(fp8), skip_tokenizer_init=True, show_progress=False)


def test_malformed_expert_scale(sources: dict[str, Path], tmp_path: Path) -> None:
    fp8, _ = _fp8_pair(sources, "qwen3_moe", tmp_path)
    malformed = {"model.layers.0.mlp.experts.3.down_proj.weight_scale_inv": torch.ones(5, 1)}
    rewrite_tensors(fp8, lambda t: t.update(malformed))
    with pytest.raises(WeightLoadError, match="expert 3 down"):
        LLM(str(fp8), skip_tokenizer_init=True, show_progress=False)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"quant_method": "awq"}, "checkpoint quantization 'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "format 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "activation_scheme": "calibrated"}, "activation_scheme 'calibrated'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "multiple of 128"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ],
)
def test_unsupported_quantization_config_is_refused(
    section: dict[str, Any], message: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    for item in sources["llama"].iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    with pytest.raises(ModelNotSupported, match=message):
        LLM(str(folder), skip_tokenizer_init=True, show_progress=False)


def test_unknown_quantization_option_is_refused(sources: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="quantization must be one of fp8"):
        LLM(str(sources["llama"]), skip_tokenizer_init=True, quantization="int4", show_progress=False)
    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be one of"):
        LLM(str(sources["llama"]), skip_tokenizer_init=True, kv_cache_dtype="fp8_e5m2", show_progress=False)
