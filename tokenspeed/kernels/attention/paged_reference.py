"""Reference paged attention: the oracle every faster attention kernel is tested against.

It deliberately reads keys and values back *through the page table* instead of
using the freshly projected K/V, so a wrong slot mapping, page table or cache
layout shows up as wrong logits rather than being hidden. It loops over rows
and computes in fp32; clarity matters more than speed here.

Masking follows Hugging Face: key j is visible to query i iff j <= i and, with
a sliding window w, i - j < w.

Three registered modes share one row routine, so they agree to the last bit:
`attention.extend` (any number of new tokens per row), `attention.decode`
(one per row; the fast kernels for it differ, hence its own mode) and
`attention.verify` (q_len tokens in every row: speculative verification).
`paged_attention_reference` (store this step's K/V, then extend) is the
whole-layer oracle of the tests; no layer selects it, so it is not registered.

FP8 KV cache: every mode takes `k_scale` / `v_scale` (fp32 `[kv_heads]` or
`[1]`, see `quant/fp8.kv_scale_layout`); cached fp8 values are read as
value * scale of their head (None: 1.0). bf16/fp32 caches take no scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenspeed.kernels.kvstore.reference import write_kv_reference
from tokenspeed.kernels.quant.fp8 import byte_view, dequantize_kv
from tokenspeed.kernels.registry import Band, register_kernel

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows `[tokens, kv_heads, head_dim]` into the paged caches at flat slots."""
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def gather_row_kv(cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions 0..seq_len-1 of one row, read through its page table: `[seq_len, kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    pages = page_table_row[positions // page_size].long()
    return byte_view(cache)[pages, positions % page_size].view(cache.dtype)


def _attend_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The last `q.shape[0]` positions of one row attend causally to its `seq_len` cached positions."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    if seq_len == 0:  # a padding row (CUDA-graph batches): no keys, zero output
        return torch.zeros_like(q)
    group = num_heads // num_kv_heads
    keys = dequantize_kv(gather_row_kv(k_cache, page_table_row, seq_len), k_scale)  # fp32 [S, Hkv, D]
    values = dequantize_kv(gather_row_kv(v_cache, page_table_row, seq_len), v_scale)
    # [Hkv, group, q_len, D] so each kv head serves its group of query heads.
    queries = q.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    scores = torch.einsum("hgqd,shd->hgqs", queries, keys) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= (q_pos - k_pos) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    context = torch.einsum("hgqs,shd->qhgd", probs, values)
    return context.reshape(q_len, num_heads, head_dim).to(q.dtype)


@register_kernel("attention", "extend", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's new tokens attend to its cached prefix plus, causally, to each other.

    q: `[tokens, heads, head_dim]`; caches: `[num_pages, page_size, kv_heads, head_dim]`
    (this step's K/V already stored); query_start `[rows + 1]`, seq_lens `[rows]`
    (KV length after this step), page_table `[rows, max_pages]`. `max_query_len`
    is only a launch hint for fast kernels. Returns `[tokens, heads, head_dim]` in q's dtype.
    """
    del max_query_len
    starts, lens = query_start.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    for row, seq_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        if end > start:
            out[start:end] = _attend_row(
                q[start:end], k_cache, v_cache, page_table[row], seq_len, scale, sliding_window, k_scale, v_scale
            )
    return out


@register_kernel("attention", "decode", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row (q `[rows, heads, head_dim]`) over its `seq_lens[row]` cached positions.

    `num_splits` only steers how fast kernels partition long contexts; rows with
    seq_len 0 (batch padding) yield zeros.
    """
    del num_splits
    out = torch.empty_like(q)
    for row, seq_len in enumerate(seq_lens.tolist()):
        out[row] = _attend_row(
            q[row : row + 1], k_cache, v_cache, page_table[row], seq_len, scale, sliding_window, k_scale, v_scale
        )[0]
    return out


@register_kernel("attention", "verify", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def verify_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    fold: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q_len` query tokens per row (q `[rows * q_len, heads, head_dim]`, speculative verification) at
    the last q_len of each row's `seq_lens[row]` positions, causal. A token at a position below 0
    (batch padding shorter than q_len) sees no key and yields zeros. `num_splits` and `fold` only steer
    fast kernels."""
    del num_splits, fold
    out = torch.zeros_like(q)
    for row, seq_len in enumerate(seq_lens.tolist()):
        seen = min(q_len, seq_len)  # tokens at positions >= 0
        if seen:
            end = (row + 1) * q_len
            out[end - seen : end] = _attend_row(
                q[end - seen : end], k_cache, v_cache, page_table[row], seq_len, scale, sliding_window, k_scale,
                v_scale,
            )
    return out


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V, then attend causally over each row's whole history.

    q: `[tokens, heads, head_dim]`; k, v: `[tokens, kv_heads, head_dim]`;
    caches: `[num_pages, page_size, kv_heads, head_dim]`. Returns `[tokens, heads, head_dim]`
    in q's dtype. `heads` must be a multiple of `kv_heads` (GQA; MQA when kv_heads == 1).
    """
    write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return extend_attention_reference(
        q,
        k_cache,
        v_cache,
        torch.as_tensor(attn.query_start),
        torch.as_tensor(attn.seq_lens),
        attn.page_table,
        scale=scale,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
