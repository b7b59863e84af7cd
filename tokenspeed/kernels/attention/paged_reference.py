"""Reference paged attention: the oracle every faster attention kernel is tested against.

It deliberately reads keys and values back *through the page table* instead of
using the freshly projected K/V, so a wrong slot mapping, page table or cache
layout shows up as wrong logits rather than being hidden. It loops over rows
and computes in fp32; clarity matters more than speed here.

Masking follows Hugging Face: key j is visible to query i iff j <= i and, with
a sliding window w, i - j < w.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenspeed.kernels.registry import Band, register_kernel

if TYPE_CHECKING:
    from tokenspeed.executor.forward_batch import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows `[tokens, kv_heads, head_dim]` into the paged caches at flat slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_row_kv(cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions 0..seq_len-1 of one row, read through its page table: `[seq_len, kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    pages = page_table_row[positions // page_size]
    return cache[pages, positions % page_size]


@register_kernel("attention", "paged", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def paged_attention_reference(
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
    """Store this step's K/V, then attend causally over each row's whole history.

    q: `[tokens, heads, head_dim]`; k, v: `[tokens, kv_heads, head_dim]`;
    caches: `[num_pages, page_size, kv_heads, head_dim]`. Returns `[tokens, heads, head_dim]`
    in q's dtype. `heads` must be a multiple of `kv_heads` (GQA; MQA when kv_heads == 1).
    """
    write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for row in range(attn.num_rows):
        start, end = attn.query_start[row], attn.query_start[row + 1]
        q_len, seq_len = end - start, attn.seq_lens[row]
        if q_len == 0:
            continue
        keys = gather_row_kv(k_cache, attn.page_table[row], seq_len).float()  # [S, Hkv, D]
        values = gather_row_kv(v_cache, attn.page_table[row], seq_len).float()
        # [Hkv, group, q_len, D] so each kv head serves its group of query heads.
        queries = q[start:end].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,shd->hgqs", queries, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        context = torch.einsum("hgqs,shd->qhgd", probs, values)
        out[start:end] = context.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out
