"""`MoEConfig`: the mixture-of-experts part of a model, normalised from HF `config.json`.

Qwen3-MoE, Mixtral and DeepSeek-V2/V3 describe the same thing (a router picks
k of E experts per token, optionally over expert groups, optionally with shared
experts beside them) with different key names and defaults; transformers v5
adds its own spellings (`num_local_experts` for Qwen3-MoE's `num_experts`).
Reading them here once means the MoE layer and the routing kernels see one
vocabulary: `scoring`, `renormalize`, `num_groups`/`topk_groups`,
`group_scoring`, `routed_scaling_factor`, and a per-layer sparse/dense flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed.errors import ModelNotSupported


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    moe_intermediate_size: int  # per routed expert
    scoring: str  # "softmax" | "sigmoid": how router logits become scores
    renormalize: bool  # rescale the k chosen weights to sum to 1 (`norm_topk_prob`)
    num_groups: int | None = None  # expert groups (DeepSeek `n_group`); None = no group limit
    topk_groups: int | None = None  # groups a token may route into (`topk_group`)
    group_scoring: str = "max"  # "max" (V2 group_limited_greedy) | "top2_sum" (V3 noaux_tc)
    has_correction_bias: bool = False  # V3 `e_score_correction_bias` steers the choice, not the weight
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # always-on experts of `moe_intermediate_size` each, fused into one MLP
    sparse_layers: tuple[bool, ...] = ()  # per layer: True = MoE block, False = dense MLP

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


def moe_config_from_hf(raw: Mapping[str, Any], model_type: str, num_layers: int) -> MoEConfig | None:
    """The MoE description of `raw`, or None for a dense model."""
    if model_type == "mixtral":
        return _mixtral(raw, num_layers)
    if model_type == "qwen3_moe":
        return _qwen3_moe(raw, num_layers)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(raw, model_type, num_layers)
    return None


def _int(raw: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        if raw.get(key) is not None:
            return int(raw[key])
    raise ModelNotSupported(f"config.json lacks {' / '.join(repr(k) for k in keys)}")


def _mixtral(raw: Mapping[str, Any], num_layers: int) -> MoEConfig:
    return MoEConfig(
        num_experts=_int(raw, "num_local_experts", "num_experts"),
        top_k=_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=_int(raw, "intermediate_size"),
        scoring="softmax",
        renormalize=True,  # Mixtral: softmax over the k chosen logits == softmax + renormalise
        sparse_layers=(True,) * num_layers,
    )


def _qwen3_moe(raw: Mapping[str, Any], num_layers: int) -> MoEConfig:
    num_experts = _int(raw, "num_experts", "num_local_experts")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(
        num_experts=num_experts,
        top_k=_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        scoring="softmax",
        renormalize=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _deepseek(raw: Mapping[str, Any], model_type: str, num_layers: int) -> MoEConfig:
    # V3 (and transformers' DeepseekV3) always routes noaux_tc with sigmoid scores;
    # V2 checkpoints name their method, defaulting to plain greedy softmax.
    # Absent keys take transformers' per-version defaults (V3: norm_topk_prob True,
    # routed_scaling_factor 2.5, 1 shared expert, 3 dense layers; V2: False, 1.0, 2, 0).
    v3 = model_type == "deepseek_v3"

    def int_or(key: str, default: int) -> int:
        return default if raw.get(key) is None else int(raw[key])

    default_method = "noaux_tc" if v3 else "greedy"
    method = str(raw.get("topk_method") or default_method)
    scoring = str(raw.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax"))
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ModelNotSupported(f"DeepSeek topk_method {method!r} is unsupported")
    if scoring not in ("softmax", "sigmoid"):
        raise ModelNotSupported(f"DeepSeek scoring_func {scoring!r} is unsupported")
    grouped = method != "greedy" and raw.get("n_group") is not None
    first_dense = int_or("first_k_dense_replace", 3 if v3 else 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    num_experts = _int(raw, "n_routed_experts")
    sparse = tuple(num_experts > 0 and i >= first_dense and i % freq == 0 for i in range(num_layers))
    norm_topk = bool(raw.get("norm_topk_prob", v3))
    scaling = float(raw.get("routed_scaling_factor") or (2.5 if v3 else 1.0))
    if norm_topk and not v3:  # DeepSeek-V2's own code normalises *instead of* scaling
        scaling = 1.0
    return MoEConfig(
        num_experts=num_experts,
        top_k=_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        scoring=scoring,
        renormalize=norm_topk,
        num_groups=int(raw["n_group"]) if grouped else None,
        topk_groups=int(raw["topk_group"]) if grouped else None,
        group_scoring="top2_sum" if method == "noaux_tc" else "max",
        has_correction_bias=method == "noaux_tc",
        routed_scaling_factor=scaling,
        num_shared_experts=int_or("n_shared_experts", 1 if v3 else 2),
        sparse_layers=sparse,
    )
