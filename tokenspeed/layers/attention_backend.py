"""`PagedAttentionBackend`: the three kernels one attention layer needs, chosen once at build time.

A step stores its new K/V (`kvstore.write`) and then runs the decode kernel
(every row has one new token: the common step of a serving engine,
memory-bound, split-KV), the verify kernel (every row has the same few
tokens: speculative decoding's last token and k drafts, still memory-bound),
or the extend kernel (prefill chunks, possibly mixed with decodes,
compute-bound). Which *implementations* serve those modes is
decided here, when the model is built, from the registry; per call the only
Python left is a comparison of shapes (`uniform_query_len`). It is layer
glue, not a kernel, so it lives in `layers/` beside `MLABackend` (`mla.py`).

Kernels take tensors only. The metadata should therefore carry device tensors
(`query_start_tensor` int32 `[rows + 1]`, `seq_lens_tensor` int32 `[rows]`;
or `query_start` / `seq_lens` may themselves be tensors) and, for CUDA graphs,
`num_kv_splits` fixed per captured batch bucket. Where a field is missing it is
derived here from the host lists, which is correct but costs a host-to-device
copy per layer, so it is only the eager fallback.

FP8 KV cache: `k_scale` / `v_scale` (fp32 `[1]` or `[kv_heads]`, `kv_scales.py`)
go to every kernel that touches the cache: the write, decode, verify
(speculative decoding) and extend alike; None for a cache in the model dtype.
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


# Verify batches (every row the same q_len = k+1 tokens, speculative decoding) up to this many tokens
# a row take the multi-query decode kernel; longer rows are prefill-like and take the extend kernel.
VERIFY_MAX_QUERY_LEN = 16


def uniform_query_len(attn: AttentionMetadata, num_tokens: int, num_rows: int) -> int | None:
    """The tokens every row has when all rows have the same number (1: decode), from shapes only."""
    q_len = attn.max_query_len
    return q_len if q_len >= 1 and num_tokens == num_rows * q_len else None


@dataclass(frozen=True, slots=True)
class PagedAttentionBackend:
    write: KernelSpec
    decode: KernelSpec
    extend: KernelSpec
    verify: KernelSpec

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
            verify=select_kernel("attention", "verify", platform=platform, dtype=dtype, traits=traits),
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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v `[tokens, kv_heads, head_dim]`, then attend q `[tokens, heads, head_dim]`."""
        self.write.impl(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return self.attend(q, k_cache, v_cache, attn, scale=scale, sliding_window=sliding_window,
                           k_scale=k_scale, v_scale=v_scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend q `[tokens, heads, head_dim]` over caches that already hold this step's K/V."""
        seq_lens = int_tensor_field(attn, "seq_lens", q.device)
        q_len = uniform_query_len(attn, q.shape[0], seq_lens.shape[0])
        if q_len == 1:
            return self.decode.impl(
                q,
                k_cache,
                v_cache,
                attn.page_table,
                seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                num_splits=getattr(attn, "num_kv_splits", None),
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if q_len is not None and q_len <= VERIFY_MAX_QUERY_LEN:
            return self.verify.impl(
                q,
                k_cache,
                v_cache,
                attn.page_table,
                seq_lens,
                q_len=q_len,
                scale=scale,
                sliding_window=sliding_window,
                num_splits=getattr(attn, "num_kv_splits", None),
                k_scale=k_scale,
                v_scale=v_scale,
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
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def __repr__(self) -> str:
        return (f"PagedAttentionBackend(write={self.write.name}, decode={self.decode.name}, "
                f"extend={self.extend.name}, verify={self.verify.name})")
