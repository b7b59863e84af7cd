"""CPU extend attention: one fused SDPA call per prefill row, the step's decode rows batched in one call.

The REFERENCE extend materialises every row's fp32 `[heads, q_len, seq_len]`
scores, mask and probabilities as separate tensors: on a 512-token prompt that
is ~10 passes over 8 MB per layer, which made prefill the larger part of a CPU
serving step (16 prompts of 512 tokens: ~13 s in the reference, most of it
`copy_`, `mul`, `masked_fill`, `softmax`). torch's CPU
`scaled_dot_product_attention` is a blocked (flash) kernel that never writes
the score matrix, so this kernel only gathers each row's pages (one contiguous
copy per page, as `decode_torch_batched`) and hands queries, keys and values
to it (4-D, kv heads repeated for GQA).

A mixed step (prefill chunks plus the running requests' decodes, the usual
step under load) sends every one-token row to the batched decode kernel in a
single call, so the cost of the decodes does not grow with a Python loop.

Causal rows of ~100-1000 positions attend in query blocks of 64, each over
the keys up to its last position with its own additive mask (`causal_blocks`):
torch's kernel splits keys in blocks of 512 and so skips no part of the upper
triangle on such rows.

Masking is the reference's: the `q_len` new tokens sit at positions
`seq_len - q_len .. seq_len - 1`; query i sees key j iff j <= i and, with a
sliding window w, i - j < w. A prompt that starts at position 0 is plain
causal (`is_causal`); a chunk after a cached prefix or a windowed layer gets
an explicit boolean mask. Queries, keys and values are computed in fp32 like
the reference, so on an fp32 model the two agree to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.attention.decode_torch_batched import decode_attention_torch_batched
from tokenspeed.kernels.quant.fp8 import byte_view, dequantize_kv
from tokenspeed.kernels.registry import Band, register_kernel

# Causal rows of more than CAUSAL_BLOCK new tokens and at most CAUSAL_BLOCKED_MAX_LEN positions attend
# in query blocks of CAUSAL_BLOCK (see `causal_blocks`).
CAUSAL_BLOCK = 64
CAUSAL_BLOCKED_MAX_LEN = 1024


def gather_positions(
    cache: torch.Tensor, page_table_row: torch.Tensor, first: int, end: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """Positions first..end-1 of one row as fp32 `[kv_heads, end - first, head_dim]`, read page by page."""
    page_size = cache.shape[1]
    first_page, last_page = first // page_size, (end + page_size - 1) // page_size
    pages = page_table_row[first_page:last_page].long()
    flat = byte_view(cache).reshape(cache.shape[0], -1).index_select(0, pages).view(cache.dtype)
    rows = flat.view(-1, cache.shape[2], cache.shape[3])
    offset = first - first_page * page_size
    return dequantize_kv(rows[offset : offset + end - first], scale).transpose(0, 1)


def causal_blocks(q_len: int, seq_len: int, device: torch.device) -> list[tuple[int, int, torch.Tensor]] | None:
    """The query blocks of a row whose last `q_len` of `seq_len` positions attend causally, each with its
    additive mask: (start, end, `[end - start, seq_len - q_len + end]` fp32); None: attend in one call.

    torch's flash CPU kernel splits keys in blocks of 512 and skips those wholly above the diagonal, so
    on a row of up to ~1000 positions `is_causal` still computes every score (and an explicit mask is
    read in full). Queries in blocks of `CAUSAL_BLOCK`, each over the keys up to its own last position,
    skip the upper triangle: measured on the embedded model's shapes (8 heads over 2, head_dim 32, one
    thread) 3.9 -> 2.8 ms at 512 tokens, 11.6 -> 10.1 at 1024 (masks made once), no gain past that.
    """
    if q_len <= CAUSAL_BLOCK or seq_len > CAUSAL_BLOCKED_MAX_LEN:
        return None
    prefix = seq_len - q_len
    blocks = []
    for start in range(0, q_len, CAUSAL_BLOCK):
        end = min(q_len, start + CAUSAL_BLOCK)
        q_pos = torch.arange(prefix + start, prefix + end, device=device)[:, None]
        k_pos = torch.arange(prefix + end, device=device)[None, :]
        mask = torch.zeros(end - start, prefix + end, device=device).masked_fill_(k_pos > q_pos, float("-inf"))
        blocks.append((start, end, mask))
    return blocks


def attend_causal_blocks(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: list[tuple[int, int, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """queries `[1, heads, q_len, D]` over keys/values `[1, heads, seq_len, D]` block by block
    (`causal_blocks`); `[q_len, heads, D]` fp32."""
    q_len, prefix = queries.shape[2], keys.shape[2] - queries.shape[2]
    out = torch.empty(q_len, queries.shape[1], values.shape[-1], dtype=queries.dtype, device=queries.device)
    for start, end, mask in blocks:
        visible = prefix + end
        part = F.scaled_dot_product_attention(
            queries[:, :, start:end], keys[:, :, :visible], values[:, :, :visible], attn_mask=mask, scale=scale
        )
        out[start:end] = part[0].transpose(0, 1)
    return out


def attend_row_sdpa(
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
    """The last `q.shape[0]` positions of one row attend causally to its cached positions; `[q_len, heads, D]`."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # Keys no query of this row can see (before the first query's window) are never gathered.
    first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
    keys = gather_positions(k_cache, page_table_row, first, seq_len, k_scale)
    values = gather_positions(v_cache, page_table_row, first, seq_len, v_scale)
    queries = q.float().transpose(0, 1)[None]  # [1, heads, q_len, D]
    if num_heads != num_kv_heads:
        # Each kv head repeated for its group: the fused (flash) CPU kernel takes 4-D MHA only;
        # `enable_gqa` falls back to the unfused math path (measured ~5x slower on 512 tokens).
        keys, values = (t.repeat_interleave(num_heads // num_kv_heads, dim=0) for t in (keys, values))
    keys, values = keys[None], values[None]
    blocks = causal_blocks(q_len, seq_len, q.device) if sliding_window is None else None
    if blocks is not None:
        return attend_causal_blocks(queries, keys, values, blocks, scale).to(q.dtype)
    if first == 0 and q_len == seq_len and sliding_window is None:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= (q_pos - k_pos) < sliding_window
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1).to(q.dtype)


@register_kernel(
    "attention",
    "extend",
    name="torch_sdpa",
    band=Band.PORTABLE,
    platforms=("cpu",),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
)
def extend_attention_torch_sdpa(
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

    The signature and result are `extend_attention_reference`'s: q `[tokens, heads, head_dim]`,
    caches `[num_pages, page_size, kv_heads, head_dim]` (this step's K/V already stored),
    query_start `[rows + 1]`, seq_lens `[rows]` (KV length after this step), page_table
    `[rows, max_pages]`; `[tokens, heads, head_dim]` in q's dtype. Rows of seq_len 0 give zeros.
    """
    del max_query_len
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    starts, lens = query_start.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    decode_rows = [row for row in range(len(lens)) if starts[row + 1] - starts[row] == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long)
        tokens = torch.tensor([starts[row] for row in decode_rows], dtype=torch.long)
        out[tokens] = decode_attention_torch_batched(
            q.index_select(0, tokens), k_cache, v_cache, page_table.index_select(0, rows),
            seq_lens.index_select(0, rows), scale=scale, sliding_window=sliding_window,
            k_scale=k_scale, v_scale=v_scale,
        )
    for row, seq_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        if end - start <= 1:
            continue
        if seq_len == 0:
            out[start:end] = 0
            continue
        if end - start > seq_len:
            raise ValueError(f"row {row} has {end - start} new tokens but only {seq_len} cached positions")
        out[start:end] = attend_row_sdpa(
            q[start:end], k_cache, v_cache, page_table[row], seq_len, scale, sliding_window, k_scale, v_scale
        )
    return out
