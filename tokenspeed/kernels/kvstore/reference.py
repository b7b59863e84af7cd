"""Reference K/V store: scatter this step's K/V rows into the paged caches.

Slots below zero are skipped. The executor pads CUDA-graph batches to a fixed
size and marks the padding tokens with slot -1, so the same captured graph can
run any smaller batch without writing garbage into a live page.
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel


@register_kernel("kvstore", "write", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v `[tokens, kv_heads, head_dim]` -> caches `[num_pages, page_size, kv_heads, head_dim]` at flat slots."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    # Indexing by (page, offset) rather than a flat view also serves non-contiguous caches.
    k_cache[pages, offsets] = k.to(k_cache.dtype)
    v_cache[pages, offsets] = v.to(v_cache.dtype)
