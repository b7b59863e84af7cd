"""`ModelConfig`: one normalised description of a dense decoder, read from HF `config.json`.

Why normalise instead of passing the HF dict around: real checkpoints and
transformers v5 disagree on spelling (`rope_theta`/`rope_scaling` vs
`rope_parameters`, `torch_dtype` vs `dtype`, `type` vs `rope_type`), and the
per-architecture quirks (Qwen2 always has q/k/v bias, Qwen3 has q/k norm and
a 128 head_dim default, Qwen sliding windows only when `use_sliding_window`)
belong in one place, not spread over layers. Everything downstream (layers,
loader, executor KV sizing) reads only this dataclass and never transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenspeed.errors import ModelNotSupported
from tokenspeed.layers.mla_config import MLAConfig, mla_config_from_hf
from tokenspeed.layers.moe_config import MoEConfig, moe_config_from_hf
from tokenspeed.layers.rope_scaling import SUPPORTED_ROPE_TYPES, RopeConfig


@dataclass(frozen=True, slots=True)
class _ArchitectureTraits:
    qkv_bias_always: bool = False  # Qwen2: q/k/v carry a bias whatever `attention_bias` says
    o_proj_bias_follows_attention_bias: bool = True
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    default_head_dim: int | None = None  # Qwen3Config defaults head_dim to 128, not hidden/heads
    sliding_window_style: str = (
        "none"  # "none" | "all" (Mistral) | "qwen" (use_sliding_window + max_window_layers)
    )
    has_mlp_bias: bool = False


_ARCHITECTURES: dict[str, _ArchitectureTraits] = {
    "LlamaForCausalLM": _ArchitectureTraits(has_mlp_bias=True),
    "MistralForCausalLM": _ArchitectureTraits(sliding_window_style="all"),
    "Qwen2ForCausalLM": _ArchitectureTraits(
        qkv_bias_always=True, o_proj_bias_follows_attention_bias=False, sliding_window_style="qwen"
    ),
    "Qwen3ForCausalLM": _ArchitectureTraits(qk_norm=True, default_head_dim=128, sliding_window_style="qwen"),
    "Qwen3MoeForCausalLM": _ArchitectureTraits(
        qk_norm=True, default_head_dim=128, sliding_window_style="qwen"
    ),
    "MixtralForCausalLM": _ArchitectureTraits(sliding_window_style="all"),
    "DeepseekV2ForCausalLM": _ArchitectureTraits(),
    "DeepseekV3ForCausalLM": _ArchitectureTraits(),
}

_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

_ARCHITECTURE_TO_MODEL_TYPE = {arch: model_type for model_type, arch in _MODEL_TYPE_TO_ARCHITECTURE.items()}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # checkpoint dtype name, e.g. "bfloat16"
    moe: MoEConfig | None = None  # mixture-of-experts layers (Qwen3-MoE, Mixtral, DeepSeek)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )

    # HF spellings, for callers that think in config.json terms.
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def torch_dtype(self) -> str | None:
        return self.dtype

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, K values per head, V values per head) stored per token and layer; V 0 = K only (MLA)."""
        if self.mla is not None:
            return 1, self.mla.cache_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Normalise a HF `config.json` dict; raises ModelNotSupported for anything we cannot run."""
        architecture = _architecture_of(raw)
        traits = _ARCHITECTURES[architecture]
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelNotSupported(f"hidden_act {hidden_act!r} is unsupported; only 'silu'")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
            intermediate = int(raw["intermediate_size"])
        except KeyError as missing:
            raise ModelNotSupported(f"config.json of {architecture} lacks {missing.args[0]!r}") from None
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = raw.get("head_dim") or traits.default_head_dim or hidden // heads
        # The family the architecture belongs to, not the checkpoint's own name for it: Kimi-K2 says
        # "kimi_k2" and is DeepseekV3ForCausalLM, parsed (MLA, MoE) as deepseek_v3.
        model_type = _ARCHITECTURE_TO_MODEL_TYPE[architecture]
        mla = mla_config_from_hf(raw, model_type)
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # the rotary width; MLA's other dims live in `mla`
        if heads % kv_heads:
            raise ModelNotSupported(f"{heads} attention heads do not group over {kv_heads} kv heads")
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = (
            () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
        )
        max_pos = int(raw.get("max_position_embeddings", 2048))
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope_config_from_hf({**raw, "max_position_embeddings": max_pos}),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or traits.qkv_bias_always,
            o_proj_bias=attention_bias and traits.o_proj_bias_follows_attention_bias,
            mlp_bias=traits.has_mlp_bias and bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            sliding_windows=_sliding_windows(raw, traits.sliding_window_style, num_layers),
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_ids=eos_ids,
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            moe=moe_config_from_hf(raw, model_type, num_layers),
            mla=mla,
            raw=dict(raw),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder}")
        return cls.from_dict(json.loads(path.read_text()))


def rope_config_from_hf(raw: Mapping[str, Any]) -> RopeConfig:
    """Read `rope_parameters` (v5) or top-level `rope_theta` + `rope_scaling` (checkpoints)."""
    params = dict(raw.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ModelNotSupported("per-layer-type rope_parameters are not supported for this architecture")
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping):
        raise ModelNotSupported(f"rope_scaling must be an object, got {scaling!r}")
    merged: dict[str, Any] = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelNotSupported(
            f"rope type {rope_type!r} is unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    original = merged.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn"):
        original = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings"))

    def opt_float(key: str) -> float | None:
        value = merged.get(key)
        return None if value is None else float(value)

    config = RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        partial_rotary_factor=float(partial if partial is not None else 1.0),
        factor=opt_float("factor"),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=opt_float("low_freq_factor"),
        high_freq_factor=opt_float("high_freq_factor"),
        attention_factor=opt_float("attention_factor"),
        beta_fast=opt_float("beta_fast"),
        beta_slow=opt_float("beta_slow"),
        mscale=opt_float("mscale"),
        mscale_all_dim=opt_float("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )
    config.validate()
    return config


def _architecture_of(raw: Mapping[str, Any]) -> str:
    names = list(raw.get("architectures") or [])
    if not names and raw.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        names = [_MODEL_TYPE_TO_ARCHITECTURE[raw["model_type"]]]
    for name in names:
        if name in _ARCHITECTURES:
            return str(name)
    shown = ", ".join(names) or f"model_type={raw.get('model_type')!r}"
    raise ModelNotSupported(
        f"unsupported architecture {shown}; supported architectures: {', '.join(supported_architectures())}"
    )


def _sliding_windows(raw: Mapping[str, Any], style: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window, mirroring how each HF architecture decides which layers slide."""
    window = raw.get("sliding_window")
    if style == "qwen" and not raw.get("use_sliding_window", False):
        window = None
    if style == "none" or window is None:
        return (None,) * num_layers
    window = int(window)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelNotSupported(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if style == "all":
        return (window,) * num_layers
    first_sliding = int(raw.get("max_window_layers", 28))
    return tuple(window if i >= first_sliding else None for i in range(num_layers))
