"""Per-tensor and per-channel FP8 checkpoints (vLLM's `fp8` without blocks, compressed-tensors float8) on the CPU.

Each tiny checkpoint is quantised by hand (`tests/fp8_checkpoints.py`: amax /
448 per weight or per row, no engine code) and transformers runs the
dequantised weights (w_fp8.float() * scale) in fp32. The engine loads the
fp8 weights as they are, with their scales made one per output row (a
per-tensor scale repeated over its weight's rows), and runs them through
`gemm.fp8` / `moe.experts_fp8` (the references on the CPU dequantise on the
fly): greedy tokens must be identical and logprobs close. A scale put on the
wrong rows (q's on k's, an expert's on its neighbour's) or not applied
changes the logits far beyond the tolerance. Each checkpoint leaves some
modules unquantised through its own list (`ignored_layers` / `ignore`, exact
names and `re:` patterns). Static activation scales are checked and unused:
activations are quantised dynamically, as for every FP8 checkpoint.

Malformed scales are WeightLoadErrors naming the tensor; schemes the engine
cannot run are ModelNotSupported naming the field; two ranks give one
rank's tokens and logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import load_hf
from tests.fp8_checkpoints import (
    SCALED_FORMATS,
    assert_matches_transformers,
    assert_two_ranks_match_one,
    compressed_tensors_section,
    dequantised_checkpoint,
    fp8_parameters,
    make_source,
    rewrite_tensors,
    to_block_fp8,
    to_scaled_fp8,
)
from tokenspeed import LLM
from tokenspeed.errors import ModelNotSupported
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, PER_CHANNEL_BLOCK
from tokenspeed.models import WeightLoadError
from tokenspeed.models.quant_config import WeightScales, resolve_quantization

ROUTERS = "re:.*mlp.gate$"  # what Qwen3-MoE's FP8 checkpoints list: their routers are not quantised
# case -> (family, format, unquantised modules, (a parameter left in fp32 by them, its quantised peer))
CASES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, str]]] = {
    "llama_fp8_static": ("llama", "fp8_static", ("model.layers.0.mlp.down_proj",),
                         ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight")),
    "llama_fp8_dynamic": ("llama", "fp8_dynamic", ("model.layers.1.self_attn.o_proj",),
                          ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight")),
    "llama_ct_channel": ("llama", "ct_channel", ("lm_head", r"re:model\.layers\.0\.self_attn\..*"),
                         ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight")),
    "llama_ct_tensor": ("llama", "ct_tensor",
                        ("lm_head", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"),
                        ("model.layers.1.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight")),
    "qwen3_moe_fp8_static": ("qwen3_moe", "fp8_static", ("model.layers.1.mlp.down_proj",),
                             ("model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.o_proj.weight")),
    "qwen3_moe_fp8_dynamic": ("qwen3_moe", "fp8_dynamic", ("model.layers.2.self_attn.o_proj",),
                              ("model.layers.2.self_attn.o_proj.weight", "model.layers.0.mlp.experts.w2")),
    "qwen3_moe_ct_channel": ("qwen3_moe", "ct_channel", ("lm_head", ROUTERS, r"re:model\.layers\.0\.mlp\.experts\."),
                             ("model.layers.0.mlp.experts.w13", "model.layers.2.mlp.experts.w13")),
    "qwen3_moe_ct_tensor": ("qwen3_moe", "ct_tensor", ("lm_head", ROUTERS, r"re:model\.layers\.1\.mlp\."),
                            ("model.layers.1.mlp.gate_up_proj.weight", "model.layers.2.mlp.experts.w13")),
    # Mixtral-8x7B-Instruct-v0.1-FP8's format: per-expert w1/w2/w3 scales and input scales under block_sparse_moe
    "mixtral_fp8_static": ("mixtral", "fp8_static", ("model.layers.0.self_attn.o_proj",),
                           ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.w2")),
    # MLA: the fused q_a / kv_a projection holds both parts' rows; kv_b_proj is dequantised to be absorbed
    "deepseek_v3_ct_channel": ("deepseek_v3", "ct_channel", ("lm_head", r"re:.*shared_experts\."),
                               ("model.layers.1.mlp.shared_experts.down_proj.weight",
                                "model.layers.0.self_attn.fused_qkv_a_proj.weight")),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scaled_fp8_sources")
    return {family: make_source(family, root / family) for family in ("llama", "qwen3_moe", "mixtral", "deepseek_v3")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scaled_fp8_checkpoint_matches_transformers(case: str, sources: dict[str, Path], tmp_path: Path) -> None:
    family, fmt, ignore, (kept, quantised_peer) = CASES[case]
    dequantised = to_scaled_fp8(sources[family], tmp_path / "fp8", fmt, ignore)
    reference = dequantised_checkpoint(sources[family], dequantised, tmp_path / "reference")
    llm = LLM(str(tmp_path / "fp8"), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=24,
              show_progress=False)
    params = dict(llm.core.executor.model.named_parameters())  # type: ignore[attr-defined]
    assert params[kept].dtype == torch.float32, f"{kept} is in the checkpoint's unquantised modules"
    assert params[quantised_peer].dtype == FP8_DTYPE
    assert not any("kv_b_proj" in name for name in fp8_parameters(llm)), "kv_b_proj must be dequantised"
    assert_matches_transformers(llm, load_hf(reference), case)


@pytest.fixture(scope="module")
def llama_checkpoints(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama in every scaled format, nothing left unquantised: copied and broken by each error test."""
    root = tmp_path_factory.mktemp("scaled_fp8_llama")
    for fmt in SCALED_FORMATS:
        to_scaled_fp8(sources["llama"], root / fmt, fmt)
    return {fmt: root / fmt for fmt in SCALED_FORMATS}


def _broken(checkpoints: dict[str, Path], fmt: str, folder: Path, change: Any) -> Path:
    """A copy of the `fmt` checkpoint in `folder`, with `change` made to its tensors."""
    folder.mkdir()
    for item in checkpoints[fmt].iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    rewrite_tensors(folder, change)
    return folder


def _set(name: str, value: torch.Tensor) -> Any:
    """A change of a checkpoint's tensors: `value` as `model.layers.<name>`, added or replacing."""
    return lambda tensors: tensors.update({f"model.layers.{name}": value})


def _with_row(rows: int, row: int, value: float) -> torch.Tensor:
    """Per-channel bf16 scales of a `rows`-row weight, all fine but `row`'s `value`."""
    scales = torch.full((rows, 1), 0.01, dtype=torch.bfloat16)
    scales[row, 0] = value
    return scales


# (format, change, what the WeightLoadError says); the tiny Llama's q_proj and o_proj have 64 rows, k_proj 32
MALFORMED = {
    "missing": ("ct_channel", lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"),
                "missing tensors: model.layers.1.mlp.up_proj.weight_scale"),
    "channel_columns": ("ct_channel", _set("0.self_attn.o_proj.weight_scale", torch.ones(64, 2)),
                        "o_proj.weight_scale: per-channel scales of a 64-row weight have shape (64, 1), got (64, 2)"),
    "channel_rows": ("ct_channel", _set("1.self_attn.q_proj.weight_scale", torch.ones(65, 1)),
                     "q_proj.weight_scale: per-channel scales of a 64-row weight have shape (64, 1), got (65, 1)"),
    "channel_zero": ("ct_channel", _set("0.self_attn.k_proj.weight_scale", _with_row(32, 3, 0.0)),
                     "k_proj.weight_scale: scales must be positive and finite, got 0.0 for row 3"),
    "channel_negative": ("ct_channel", _set("1.mlp.down_proj.weight_scale", _with_row(64, 63, -0.5)),
                         "down_proj.weight_scale: scales must be positive and finite, got -0.5 for row 63"),
    "channel_inf": ("ct_channel", _set("0.mlp.gate_proj.weight_scale", _with_row(128, 0, float("inf"))),
                    "gate_proj.weight_scale: scales must be positive and finite, got inf for row 0"),
    "tensor_two": ("ct_tensor", _set("0.self_attn.v_proj.weight_scale", torch.ones(2)),
                   "v_proj.weight_scale: a per-tensor scale has one element, got shape (2,)"),
    "tensor_zero": ("fp8_static", _set("1.self_attn.o_proj.weight_scale", torch.tensor(0.0)),
                    "o_proj.weight_scale: a scale must be positive and finite, got 0.0"),
    "tensor_nan": ("fp8_dynamic", _set("0.mlp.up_proj.weight_scale", torch.tensor(float("nan"))),
                   "up_proj.weight_scale: a scale must be positive and finite, got nan"),
    "input_negative": ("fp8_static", _set("0.self_attn.q_proj.input_scale", torch.tensor(-1.0)),
                       "q_proj.input_scale: a scale must be positive and finite, got -1.0"),
    "input_two": ("ct_tensor", _set("1.mlp.down_proj.input_scale", torch.ones(2)),
                  "down_proj.input_scale: a per-tensor scale has one element, got shape (2,)"),
    "not_fp8": ("ct_tensor", _set("0.mlp.gate_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16)),
                "gate_proj.weight: checkpoint dtype torch.bfloat16 for a torch.float8_e4m3fn parameter"),
    "input_scale_of_dynamic": ("fp8_dynamic", _set("0.mlp.up_proj.input_scale", torch.tensor(0.02)),
                               "unexpected tensors: model.layers.0.mlp.up_proj.input_scale"),
    "both_scale_names": ("ct_channel", _set("0.self_attn.o_proj.weight_scale_inv", torch.ones(64, 1)),
                         "loading the same parameter twice: model.layers.0.self_attn.o_proj.weight_scale"),
    "scale_of_a_bf16_module": ("ct_channel", _set("0.post_attention_layernorm.weight_scale", torch.ones(64, 1)),
                               "unexpected tensors: model.layers.0.post_attention_layernorm.weight_scale"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_scales_are_clear_weight_load_errors(
    case: str, llama_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    fmt, change, message = MALFORMED[case]
    folder = _broken(llama_checkpoints, fmt, tmp_path / case, change)
    with pytest.raises(WeightLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(folder), skip_tokenizer_init=True, show_progress=False)


def test_a_rank_refuses_two_tensors_for_one_parameter(llama_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A rank's loader (`rank_model.load_rank_weights`, here at world size one, no process spawned) reports a
    stray `weight_scale_inv` beside a `weight_scale` as the one-device loader does, instead of loading both."""
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.parallel.rank_model import build_rank_model
    from tokenspeed.placement.parallel_config import ParallelConfig
    from tokenspeed.placement.process_groups import create_parallel_groups

    fmt, change, message = MALFORMED["both_scale_names"]
    folder = _broken(llama_checkpoints, fmt, tmp_path / "both", change)
    config = ModelConfig.from_pretrained(folder)
    groups = create_parallel_groups(ParallelConfig().validate_for_model(config), 0)
    fp8 = resolve_quantization(config.raw, None)
    with pytest.raises(WeightLoadError, match=f"on rank 0: tensors {message}"):
        build_rank_model(config, folder, groups, dtype=torch.float32, device=torch.device("cpu"), fp8=fp8)


@pytest.mark.parametrize("fmt", ["fp8_static", "ct_tensor", "ct_channel", "block"])
def test_a_rank_reports_the_weight_missing_beside_its_scale(
    fmt: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """A scale whose weight the checkpoint lacks: a rank's loader names the weight, as the one-device loader
    does, instead of failing to cut the scale by its weight's shape (a per-tensor scale of shape () or (1,)
    went to the sharding rules as if it were a weight) or to fit it into the scale parameter."""
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.parallel.rank_model import build_rank_model
    from tokenspeed.models.parallel.sharded_reader import ShardedCheckpointReader
    from tokenspeed.placement.parallel_config import ParallelConfig
    from tokenspeed.placement.process_groups import create_parallel_groups

    folder = tmp_path / fmt
    if fmt == "block":
        to_block_fp8(sources["llama"], folder)
    else:
        to_scaled_fp8(sources["llama"], folder, fmt)
    rewrite_tensors(folder, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    config = ModelConfig.from_pretrained(folder)
    groups = create_parallel_groups(ParallelConfig().validate_for_model(config), 0)
    fp8 = resolve_quantization(config.raw, None)
    with pytest.raises(WeightLoadError, match=r"on rank 0: missing tensors: model\.layers\.1\.mlp\.up_proj\.weight$"):
        build_rank_model(config, folder, groups, dtype=torch.float32, device=torch.device("cpu"), fp8=fp8)
    # What rank 1 of two is handed: the orphan scale uncut, every other tensor cut as usual.
    topology = ParallelConfig(tensor_parallel_size=2).topology()
    uncut = [name for name, tensor, _ in ShardedCheckpointReader(folder, config, topology, 1, fp8=fp8) if tensor is None]
    assert uncut == ["model.layers.1.mlp.up_proj.weight_scale" + ("_inv" if fmt == "block" else "")]


def test_an_expert_scale_without_its_weight_goes_to_the_expert_s_rank_only(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """Under expert parallelism the rank holding the expert is handed the orphan scale (and reports the weight
    missing); the other rank skips it as it skips that expert's tensors, instead of calling it unexpected."""
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.parallel.sharded_reader import ShardedCheckpointReader
    from tokenspeed.placement.parallel_config import ParallelConfig

    to_scaled_fp8(sources["qwen3_moe"], tmp_path / "fp8", "fp8_static")
    rewrite_tensors(tmp_path / "fp8", lambda tensors: tensors.pop("model.layers.0.mlp.experts.6.up_proj.weight"))
    config = ModelConfig.from_pretrained(tmp_path / "fp8")
    fp8 = resolve_quantization(config.raw, None)
    topology = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).topology()  # experts 4-7 on rank 1
    uncut = [[name for name, tensor, _ in ShardedCheckpointReader(tmp_path / "fp8", config, topology, rank, fp8=fp8)
              if tensor is None] for rank in (0, 1)]
    assert uncut == [[], ["model.layers.0.mlp.experts.6.up_proj.weight_scale"]]


def test_malformed_expert_scale_names_the_expert(sources: dict[str, Path], tmp_path: Path) -> None:
    to_scaled_fp8(sources["qwen3_moe"], tmp_path / "fp8", "ct_channel")
    rewrite_tensors(tmp_path / "fp8", _set("0.mlp.experts.3.down_proj.weight_scale", torch.ones(5, 1)))
    with pytest.raises(WeightLoadError, match=r"experts\.3\.down_proj\.weight_scale: per-channel scales of a 64-row"):
        LLM(str(tmp_path / "fp8"), skip_tokenizer_init=True, show_progress=False)


def _ct(
    strategy: str = "channel",
    *,
    weights: dict[str, Any] | None = None,
    inputs: dict[str, Any] | None = None,
    group: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A compressed-tensors section, weights per `strategy` and dynamic per-token activations, changed:
    `weights` / `inputs` into its one group's weight / input-activation arguments, `group` into the group,
    `fields` into the section."""
    section = compressed_tensors_section(strategy, {"num_bits": 8, "type": "float", "strategy": "token",
                                                     "dynamic": True, "symmetric": True})
    only = section["config_groups"]["group_0"]
    only["weights"].update(weights or {})
    only["input_activations"].update(inputs or {})
    only.update(group or {})
    return {**section, **fields}


def _group(strategy: str) -> dict[str, Any]:
    """The one config group of `_ct(strategy)`."""
    return _ct(strategy)["config_groups"]["group_0"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (_ct(weights={"type": "int"}), r"weights: type 'int' with num_bits 8 is not supported; only type float"),
        (_ct(weights={"num_bits": 4}), r"weights: type 'float' with num_bits 4 is not supported"),
        (_ct(weights={"strategy": "block", "block_structure": [128, 128]}),
         r"weights.strategy 'block' is not supported; supported: tensor, channel"),
        (_ct(weights={"strategy": "group", "group_size": 128}), r"weights.strategy 'group' is not supported"),
        (_ct(weights={"symmetric": False}), r"weights.symmetric must be true"),
        (_ct(weights={"dynamic": True}), r"weights.dynamic must be false"),
        (_ct(inputs={"type": "int"}), r"input_activations: type 'int' with num_bits 8"),
        (_ct(inputs={"strategy": "group", "group_size": 128}),
         r"input_activations: strategy 'group' with dynamic True is not supported; supported: token \(dynamic\)"),
        (_ct(inputs={"strategy": "token", "dynamic": False}), r"strategy 'token' with dynamic False"),
        (_ct(group={"output_activations": {"num_bits": 8, "type": "float"}}), r"output_activations is not supported"),
        (_ct(group={"targets": ["Attention"]}), r"targets \['Attention'\] is not supported; only \['Linear'\]"),
        (_ct(format="int-quantized"), r"format 'int-quantized' is not supported; supported: float-quantized"),
        (_ct(config_groups={}), r"config_groups must name at least one scheme"),
        (_ct(config_groups={"group_0": _group("channel"), "group_1": _group("tensor")}),
         r"config_groups group_0, group_1 have different schemes"),
        (_ct(sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config format 'sparse-24-bitmask'"),
        (_ct(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}), r"kv_cache_scheme: type 'int'"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_refused(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelNotSupported, match=message):
        resolve_quantization({"quantization_config": section}, None)


@pytest.mark.parametrize(
    ("section", "scales", "static"),
    [
        ({"quant_method": "fp8", "activation_scheme": "static"}, WeightScales.TENSOR, True),
        ({"quant_method": "fp8"}, WeightScales.TENSOR, False),
        (_ct(), WeightScales.CHANNEL, False),
        (_ct("tensor", group={"input_activations": None}), WeightScales.TENSOR, False),  # weight-only
        (_ct("tensor", inputs={"strategy": "tensor", "dynamic": False}), WeightScales.TENSOR, True),
        (_ct(format="naive-quantized", sparsity_config={"format": "dense"},
             kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
         WeightScales.CHANNEL, False),
        (_ct(config_groups={"a": _group("channel"), "b": _group("channel")}), WeightScales.CHANNEL, False),
    ],
)
def test_supported_schemes_load_as_per_row_scales(
    section: dict[str, Any], scales: WeightScales, static: bool
) -> None:
    fp8 = resolve_quantization({"quantization_config": section}, None)
    assert fp8 is not None and fp8.serialized and fp8.block_size == PER_CHANNEL_BLOCK
    assert (fp8.weight_scales, fp8.static_input_scales) == (scales, static)
    assert fp8.weight_of_scale("model.layers.0.mlp.down_proj.weight_scale") == "model.layers.0.mlp.down_proj.weight"
    assert fp8.weight_of_scale("model.layers.0.mlp.down_proj.weight_scale_inv") is None


def test_ignore_patterns_match_from_the_name_start() -> None:
    fp8 = resolve_quantization({"quantization_config": _ct(ignore=["lm_head", ROUTERS, r"re:model\.layers\.1\."])},
                               None)
    assert fp8 is not None
    assert fp8.skips("model.layers.3.mlp.gate") and fp8.skips("model.layers.1.mlp.up_proj") and fp8.skips("lm_head")
    assert not fp8.skips("model.layers.3.mlp.gate_proj") and not fp8.skips("model.layers.10.mlp.up_proj")


# case -> (family, format, expert parallel); the others split experts by their intermediate size (MoE TP)
TP_CASES = {
    "llama_ct_channel": ("llama", "ct_channel", False),
    "qwen3_moe_ct_tensor_moe_tp": ("qwen3_moe", "ct_tensor", False),
    "qwen3_moe_fp8_static_ep": ("qwen3_moe", "fp8_static", True),
}


@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_scaled_fp8_on_two_ranks_matches_one(case: str, sources: dict[str, Path], tmp_path: Path) -> None:
    """Column-parallel layers take their rows' scales, row-parallel ones all of them, replicated per-tensor
    scales become each rank's rows; anything else changes rank 1's partial outputs."""
    family, fmt, ep = TP_CASES[case]
    to_scaled_fp8(sources[family], tmp_path / "fp8", fmt, ("lm_head", ROUTERS))
    assert_two_ranks_match_one(case, tmp_path / "fp8", ep)
