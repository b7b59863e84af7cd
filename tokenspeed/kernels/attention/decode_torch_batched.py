"""Batched torch decode attention: the CPU's `attention.decode` (PORTABLE), a few torch ops per batch.

The REFERENCE decode walks the batch row by row in Python, so its cost grows
with the number of rows even when every row is short. This kernel does the
whole batch at once:

1. from `page_table` and `seq_lens` build a `[rows, span_pages]` index of each
   row's pages (with a sliding window, only the pages holding its last
   `window` positions), padded to the longest row;
2. `index_select` whole pages of the caches into padded
   `[rows, span_pages * page_size, kv_heads, head_dim]` keys and values (one
   contiguous copy per page rather than per token); positions outside a row's
   visible range are masked, never read as data;
3. queries `[rows, heads, head_dim]` viewed as `[rows, kv_heads, group, head_dim]`
   (GQA; MQA and MHA are group = heads and group = 1) go with the gathered
   keys and values, in fp32, to one `scaled_dot_product_attention` call with
   a boolean mask of each row's visible positions: torch's fused (flash) CPU
   kernel, which never materialises the scores (measured on 2 vCPUs, 16 rows x
   1000 tokens, 8 heads over 2: 2.5 ms against 10.9 ms for the per-kv-head
   matmuls and softmax it replaced).

Masking is the reference's: the query sits at position `seq_len - 1` and sees
key j iff j <= seq_len - 1 and, with a sliding window w, (seq_len - 1) - j < w,
i.e. the last w positions including itself. Rows with seq_len 0 (batch padding)
yield zeros. To bound memory on long contexts the rows are processed in chunks
whose padded keys (values alike) stay under `ELEMENT_BUDGET` elements: a small
model's batch is one chunk, long contexts of large models go a few rows at a
time (which measured faster, see `ELEMENT_BUDGET`). A single row longer than
the budget still forms a chunk of its own (the reference materialises the same
fp32 copy of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.quant.fp8 import byte_view, dequantize_kv
from tokenspeed.kernels.registry import Band, register_kernel

# Most elements of padded keys (values alike) one chunk of rows may gather: 4M (16 MiB each in fp32).
# Measured on a 2-vCPU host (32 rows, 8 kv heads x 128, 500-2000 tokens): chunks of 4M elements or
# fewer run ~2x faster than 16M or 64M ones, whose fresh buffers miss the caches and fault in pages.
# Small-model batches (32 rows x 300 tokens x 2 x 32 = 0.6M) stay one chunk.
ELEMENT_BUDGET = 4 * 1024 * 1024


def _page_spans(
    lens: torch.Tensor, page_size: int, sliding_window: int | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per row: first visible position, first page to gather (both None without a window: 0), page count."""
    if sliding_window is None:
        return None, None, (lens + page_size - 1) // page_size
    start = (lens - sliding_window).clamp(min=0)
    first_page = start // page_size
    num_pages = torch.where(lens > start, (lens + page_size - 1) // page_size - first_page, 0)
    return start, first_page, num_pages


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    start: torch.Tensor | None,
    first_page: torch.Tensor | None,
    span_pages: int,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Single-token queries of `rows` rows over their visible positions; fp32 `[rows, heads, v_dim]`."""
    rows, num_heads, _ = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    span = span_pages * page_size
    table_idx = torch.arange(span_pages, device=q.device)
    positions = torch.arange(span, device=q.device)
    if start is None or first_page is None:  # no window: every row's pages from its first
        table = page_table[:, :span_pages]
        hidden = positions >= lens[:, None]
    else:
        table_idx = first_page[:, None] + table_idx  # [rows, span_pages]
        table = torch.gather(page_table, 1, table_idx.clamp(max=page_table.shape[1] - 1))
        positions = first_page[:, None] * page_size + positions
        hidden = (positions < start[:, None]) | (positions >= lens[:, None])
    hidden = hidden[:, None, :]  # [rows, 1, span]
    owned = table_idx * page_size < lens[:, None]  # pages past a row's end may hold anything: read page 0
    pages = table.long().masked_fill_(~owned, 0).reshape(-1)
    # Pages as flat rows: index_select over a 2-D view copies each page in one piece (~4x faster than 4-D).
    keys = byte_view(k_cache).reshape(k_cache.shape[0], -1).index_select(0, pages).view(k_cache.dtype)
    values = byte_view(v_cache).reshape(v_cache.shape[0], -1).index_select(0, pages).view(v_cache.dtype)
    keys = dequantize_kv(keys.view(rows, span, num_kv_heads, -1), k_scale)
    values = dequantize_kv(values.view(rows, span, num_kv_heads, -1), v_scale)

    # GQA folded into the query length: each kv head's `group` query heads are its queries, so torch's
    # fused CPU attention (flash, 4-D MHA) runs on the gathered layout with no repeated keys.
    queries = q.float().view(rows, num_kv_heads, group, -1)
    out = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=~hidden[:, None], scale=scale
    )
    out = out.reshape(rows, num_heads, -1)
    return out.masked_fill_((lens == 0)[:, None, None], 0.0)  # rows with no key (padding) give zeros


@register_kernel(
    "attention",
    "decode",
    name="torch_batched",
    band=Band.PORTABLE,
    platforms=("cpu",),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
)
def decode_attention_torch_batched(
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

    Caches `[num_pages, page_size, kv_heads, head_dim]`, page_table `[rows, max_pages]`
    and seq_lens `[rows]` int32 or int64. Returns `[rows, heads, head_dim]` in q's
    dtype, equal to `decode_attention_reference` up to fp32 summation order.
    fp8 caches: values times `k_scale` / `v_scale` of their head, as the reference.
    `num_splits` only steers GPU kernels and is ignored.
    """
    del num_splits
    rows, num_heads, _ = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    if rows == 0:
        return torch.empty_like(q)
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    table = page_table.to(device=q.device)
    start, first_page, num_pages = _page_spans(lens, page_size, sliding_window)
    span_pages = int(num_pages.max())
    if span_pages == 0:  # every row is padding: nothing to attend to
        return torch.zeros_like(q)
    per_page = page_size * num_kv_heads * max(k_cache.shape[-1], v_cache.shape[-1])
    chunk_rows = max(1, ELEMENT_BUDGET // (span_pages * per_page))
    if chunk_rows >= rows:  # the common case: the whole batch at once
        return _attend_chunk(
            q, k_cache, v_cache, table, lens, start, first_page, span_pages, scale, k_scale, v_scale
        ).to(q.dtype)
    out = torch.empty_like(q)
    for first in range(0, rows, chunk_rows):
        rows_here = slice(first, min(first + chunk_rows, rows))
        pages_here = int(num_pages[rows_here].max())
        if pages_here == 0:
            out[rows_here] = 0
            continue
        out[rows_here] = _attend_chunk(
            q[rows_here],
            k_cache,
            v_cache,
            table[rows_here],
            lens[rows_here],
            None if start is None else start[rows_here],
            None if first_page is None else first_page[rows_here],
            pages_here,
            scale,
            k_scale,
            v_scale,
        )
    return out
