"""What each rank holds: weight bytes (from the checkpoint inventory and the sharding rules) and KV bytes.

Weights are counted at the activation dtype's width, a serialized FP8
checkpoint's projections at one byte (their scales and the router's fp32
copy are not modelled). KV: a GQA rank
stores its kv heads (one replicated head when ATTN_TP exceeds the kv heads);
an MLA rank stores the whole latent of every token it attends, so under
attention TP every rank holds every token's latent, while under DP attention
each rank holds only its own requests' tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspeed.models.parallel.weight_inventory import checkpoint_tensors
from tokenspeed.models.parallel.weight_sharding import rule_for, slice_for_rank
from tokenspeed.placement.parallel_config import Topology
from tokenspeed.placement.plan_text import gib, runs, span

if TYPE_CHECKING:
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.quant_config import Fp8Config


@dataclass(frozen=True, slots=True)
class RankWeights:
    rank: int
    sharded_bytes: int
    replicated_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.sharded_bytes + self.replicated_bytes


def weights_per_rank(
    config: ModelConfig, topology: Topology, dtype_bytes: int, fp8: Fp8Config | None = None
) -> list[RankWeights]:
    tensors = [(t, rule_for(t.name, config, topology)) for t in checkpoint_tensors(config)]
    width = {t.name: 1 if fp8 is not None and fp8.keeps_fp8(t.name) else dtype_bytes for t, _ in tensors}
    out = []
    for rank in range(topology.world_size):
        sharded = replicated = 0
        for tensor, rule in tensors:
            part = slice_for_rank(tensor.name, rule, tensor.shape, topology, rank)
            if part is None:
                continue
            nbytes = part.numel(tensor.shape) * width[tensor.name]
            if rule.sharded:
                sharded += nbytes
            else:
                replicated += nbytes
        out.append(RankWeights(rank, sharded, replicated))
    return out


def kv_bytes_per_token(config: ModelConfig, topology: Topology, dtype_bytes: int) -> int:
    """KV bytes one rank stores per token it holds, over all layers."""
    if config.mla is not None:
        per_layer = config.mla.cache_dim
    else:
        kv_heads = max(1, config.num_kv_heads // topology.attn_tp)
        per_layer = 2 * kv_heads * config.head_dim
    return per_layer * config.num_layers * dtype_bytes


def format_footprint(weights: Sequence[RankWeights], kv_bytes_per_token: int, dp_attention: bool) -> str:
    lines = ["weights per rank:"]
    for first, last in runs(weights, lambda w: (w.sharded_bytes, w.replicated_bytes)):
        w = weights[first]
        lines.append(
            f"  {span('rank', first, last)}: {gib(w.total_bytes)}: sharded {w.sharded_bytes:,} B, "
            f"replicated {w.replicated_bytes:,} B"
        )
    holds = "its own requests' tokens (DP attention)" if dp_attention else "every token of the step"
    lines.append(f"kv cache per rank: {kv_bytes_per_token:,} B per token it holds; each rank holds {holds}")
    return "\n".join(lines)
