"""`RopeStore`: `kvstore.rope_write`'s work, handed to the QKV projection's kernel to do in its epilogue.

At one token a decode layer's QKV GEMV writes q, k and v, and `rope_write`
(a launch of its own) reads them back to rotate q and k and store k and v in
the paged caches: a link of the layer's chain of dependent kernels that moves
a few KB. The FP8 one-token GEMV can do that work itself when a program's rows
are rotate-half partners of one head (`fp8_gemv_triton`, `rope_write_triton.
rope_store_pairs`): this is what it then needs. Only for layers without q/k
norms (a per-head norm needs the whole head, which no GEMV program holds) and
with every channel rotary. `TOKENSPEED_FP8_QKV_ROPE=0` keeps `rope_write` apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeStore:
    """`rope_write`'s arguments besides q, k and v (see `kvstore.reference.rope_write_reference`)."""

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]


def rope_store_enabled() -> bool:
    """The fold's off switch (`TOKENSPEED_FP8_QKV_ROPE=0`)."""
    return os.environ.get("TOKENSPEED_FP8_QKV_ROPE", "1") != "0"
