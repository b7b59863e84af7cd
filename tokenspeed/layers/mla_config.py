"""`MLAConfig`: Multi-head Latent Attention dimensions of DeepSeek-V2/V3 (also Kimi-K2, Moonlight).

Kept apart from the dense `ModelConfig` fields because MLA changes what one
token costs in the KV cache: only the compressed latent (`kv_lora_rank`) and
the decoupled rope key (`qk_rope_head_dim`) are stored, 576 values per token
and layer for V3, instead of 2·heads·head_dim. The executor sizes the paged
pool from `cache_dim`; the page pool and prefix index are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed.errors import ModelNotSupported


@dataclass(frozen=True, slots=True)
class MLAConfig:
    q_lora_rank: int | None  # None: queries come from one full-rank projection (V2-Lite, Moonlight)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True  # DeepSeek checkpoints store rope dims pairwise (x0, x1), (x2, x3), ...
    num_mtp_layers: int = 0  # multi-token-prediction layers after the decoder (`num_nextn_predict_layers`)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values stored per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_config_from_hf(raw: Mapping[str, Any], model_type: str) -> MLAConfig | None:
    """The MLA dimensions of a DeepSeek config, None for other model types.

    As transformers reads them: V2 always rotates interleaved pairs (it
    multiplies complex numbers), V3 only while `rope_interleave` (default
    True). `q_lora_rank` null means a full-rank `q_proj`.
    """
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        return None
    try:
        q_lora = raw.get("q_lora_rank")
        config = MLAConfig(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleaved=model_type == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )
    except KeyError as missing:
        raise ModelNotSupported(f"DeepSeek config.json lacks {missing.args[0]!r}") from None
    dims = (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    if (
        min(dims) <= 0
        or config.qk_rope_head_dim % 2
        or (config.q_lora_rank is not None and config.q_lora_rank <= 0)
    ):
        raise ModelNotSupported(
            f"MLA dimensions must be positive and the rope dim even: kv_lora_rank, qk_nope_head_dim, "
            f"qk_rope_head_dim, v_head_dim = {dims}, q_lora_rank = {config.q_lora_rank}"
        )
    if raw.get("attention_bias"):
        raise ModelNotSupported("MLA with attention_bias is unsupported (no DeepSeek checkpoint uses it)")
    return config
