"""One rank's `ModelConfig`: the family's own config with this rank's share of every plainly split size.

The layers then build at local size with no parallel code of their own:
attention heads and kv heads over ATTN_TP (one kv head, replicated, when
ATTN_TP exceeds them), the dense MLP's intermediate size over the world
(DENSE_TP). Sizes that are not a plain split (vocabulary, routed and shared
experts) are the layers' own, through `placement.rank_context`.
"""

from __future__ import annotations

import dataclasses

from tokenspeed.models.config import ModelConfig
from tokenspeed.placement.parallel_config import ParallelConfigError, Topology


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ParallelConfigError(f"{what} {total} does not split over {parts} ranks")
    return total // parts


def local_model_config(config: ModelConfig, topology: Topology) -> ModelConfig:
    """`config` with this rank's attention heads, kv heads (one replicated head when ATTN_TP exceeds
    them) and dense intermediate size; MTP layers dropped (the forward pass never runs them, and
    speculative decoding is single-device for now). Identity on a world of one."""
    if topology.world_size == 1:
        return config
    tp = topology.attn_tp
    kv_heads = config.num_kv_heads // tp if tp <= config.num_kv_heads else 1
    mla = config.mla
    if mla is not None and mla.num_mtp_layers:
        mla = dataclasses.replace(mla, num_mtp_layers=0)
    # a model whose every layer is MoE never builds a dense MLP: its intermediate size need not split
    world = topology.world_size
    intermediate = config.intermediate_size // world if config.intermediate_size % world == 0 else config.intermediate_size
    return dataclasses.replace(
        config,
        num_heads=_split(config.num_heads, tp, "attention heads"),
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        mla=mla,
    )
