"""`PagedAttentionBackend`: the three kernels one attention layer needs, chosen once at build time.

A step stores its new K/V (`kvstore.write`) and then runs either the decode
kernel (every row has one new token: the common step of a serving engine,
memory-bound, split-KV) or the extend kernel (prefill chunks, possibly mixed
with decodes, compute-bound). Which *implementations* serve those modes is
decided here, when the model is built, from the registry; per call the only
Python left is one integer comparison (`max_query_len == 1`). It is layer
glue, not a kernel, so it lives in `layers/` beside `MLABackend` (`mla.py`).

Kernels take tensors only. The metadata should therefore carry device tensors
(`query_start_tensor` int32 `[rows + 1]`, `seq_lens_tensor` int32 `[rows]`;
or `query_start` / `seq_lens` may themselves be tensors) and, for CUDA graphs,
`num_kv_splits` fixed per captured batch bucket. Where a field is missing it is
derived here from the host lists, which is correct but costs a host-to-device
copy per layer, so it is only the eager fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenspeed.kernels.registry import KernelSpec, select_kernel

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata


def int_tensor_field(attn: Any, name: str, device: torch.device) -> torch.Tensor:
    """Field `name` of the metadata as an int tensor on `device` (see the module docstring)."""
    value = getattr(attn, f"{name}_tensor", None)
    if value is None:
        value = getattr(attn, name)
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.int32, device=device)


@dataclass(frozen=True, slots=True)
class PagedAttentionBackend:
    write: KernelSpec
    decode: KernelSpec
    extend: KernelSpec

    @classmethod
    def select(
        cls, *, platform: str, dtype: torch.dtype, head_dim: int, sliding_window: bool
    ) -> PagedAttentionBackend:
        """The best kernel of each mode for this layer (overrides: `TOKENSPEED_KERNEL_ATTENTION_DECODE=...`)."""
        traits = {"sliding_window": sliding_window, "head_dim": head_dim}
        return cls(
            write=select_kernel("kvstore", "write", platform=platform, dtype=dtype),
            decode=select_kernel("attention", "decode", platform=platform, dtype=dtype, traits=traits),
            extend=select_kernel("attention", "extend", platform=platform, dtype=dtype, traits=traits),
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store k/v `[tokens, kv_heads, head_dim]`, then attend q `[tokens, heads, head_dim]`."""
        self.write.impl(k, v, k_cache, v_cache, attn.slot_mapping)
        seq_lens = int_tensor_field(attn, "seq_lens", q.device)
        if attn.max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
            return self.decode.impl(
                q,
                k_cache,
                v_cache,
                attn.page_table,
                seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                num_splits=getattr(attn, "num_kv_splits", None),
            )
        return self.extend.impl(
            q,
            k_cache,
            v_cache,
            int_tensor_field(attn, "query_start", q.device),
            seq_lens,
            attn.page_table,
            scale=scale,
            sliding_window=sliding_window,
            max_query_len=attn.max_query_len,
        )

    def __repr__(self) -> str:
        return f"PagedAttentionBackend(write={self.write.name}, decode={self.decode.name}, extend={self.extend.name})"
