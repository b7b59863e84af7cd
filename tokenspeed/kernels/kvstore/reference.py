"""Reference K/V store: scatter this step's K/V rows into the paged caches.

`kvstore.rope_write` is the store with what precedes it in an attention
layer (q/k norm, RoPE): the fused kernel's oracle, and its off switch.

Slots below zero are skipped. The executor pads CUDA-graph batches to a fixed
size and marks the padding tokens with slot -1, so the same captured graph can
run any smaller batch without writing garbage into a live page.

An fp8 (e4m3) cache stores the rows quantised with static scales, one per kv
head (`[kv_heads]`) or one for all heads (`[1]`); None means 1.0. Why per
head, and the rounding: `quant/fp8.py` (`kv_scale_layout`, `quantize_kv`).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.norm.rms_reference import rms_norm_reference
from tokenspeed.kernels.quant.fp8 import byte_view, kv_for_cache
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.rope.reference import apply_rope_reference


@register_kernel("kvstore", "write", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v `[tokens, kv_heads, head_dim]` -> caches `[num_pages, page_size, kv_heads, head_dim]` at flat slots.

    fp8 caches: k / k_scale and v / v_scale (fp32 `[kv_heads]` or `[1]`, None: 1.0), rounded to e4m3.
    """
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    # Indexing by (page, offset) rather than a flat view also serves non-contiguous caches.
    byte_view(k_cache)[pages, offsets] = byte_view(kv_for_cache(k, k_cache.dtype, k_scale))
    byte_view(v_cache)[pages, offsets] = byte_view(kv_for_cache(v, v_cache.dtype, v_scale))


def check_norm_weights(q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None) -> bool:
    """Whether q/k norms apply; raises unless the weights come both or neither."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give q_norm_weight and k_norm_weight together")
    return q_norm_weight is not None


@register_kernel("kvstore", "rope_write", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def rope_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What an attention layer does before it attends, one op after the other; returns the rotated q.

    Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm, when the weights are given), RoPE of
    both (`rope.apply`), then the K/V store (`kvstore.write`). The oracle of the fused kernels.
    """
    if check_norm_weights(q_norm_weight, k_norm_weight):
        q = rms_norm_reference(q, q_norm_weight, norm_eps)
        k = rms_norm_reference(k, k_norm_weight, norm_eps)
    q, k = apply_rope_reference(q, k, positions, cos_cache, sin_cache)
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q
