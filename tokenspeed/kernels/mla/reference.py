"""Reference MLA kernels: the oracle the Triton kernels are tested against.

Like the paged attention reference, these read keys back *through the page
table*, so a wrong slot mapping or page table shows up as wrong numbers. They
compute in fp32, loop over rows and return q's dtype.

Signatures (the registered contract every faster kernel of the family keeps):

- `mla.write`: `mla_write(latent_and_rope [T, Dl+Dr], cache, slot_mapping int [T]) -> None`
  stores row t at flat slot `slot_mapping[t]` (= page * page_size + offset);
  slots below zero (CUDA-graph padding) are skipped. No host sync, so it can
  be captured in a CUDA graph.
- `mla.decode`: `mla_decode(q [T, H, Dl+Dr], cache, page_table [rows, max_pages],
  seq_lens int32 [rows], *, q_len, scale, kv_lora_rank, num_splits=None) -> [T, H, Dl]`
  with T = rows * q_len. Row r's query tokens sit at positions
  `seq_lens[r] - q_len .. seq_lens[r] - 1` and attend causally. A token that
  sees no key (padding rows of length 0, or length < q_len) yields zeros.
- `mla.extend`: `mla_extend(q [T, H, Dl+Dr], cache, query_start int32 [rows+1],
  seq_lens int32 [rows], page_table, *, scale, kv_lora_rank, max_query_len) -> [T, H, Dl]`,
  row r owning tokens `query_start[r]:query_start[r+1]` at the last positions
  of its `seq_lens[r]` cached ones.

Score = (q_latent . c_kv + q_rope . k_pe) * scale; output = softmax . c_kv.

FP8 latent cache (e4m3): every mode takes `kv_scale`, one static fp32 scale
`[1]` for the cache (the latent cache has a single "kv head", so per head
and per tensor coincide; see `quant/fp8.kv_scale_layout`). The write stores
row / kv_scale rounded to e4m3, the reads use value * kv_scale (None: 1.0).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.quant.fp8 import byte_view, dequantize_kv, kv_for_cache
from tokenspeed.kernels.registry import Band, register_kernel


def _gather_row(
    cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int, kv_scale: torch.Tensor | None
) -> torch.Tensor:
    """Positions 0..seq_len-1 of one row through its page table: `[seq_len, Dl+Dr]` in fp32."""
    page_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    pages = page_table_row[positions // page_size].long()
    return dequantize_kv(byte_view(cache)[pages, positions % page_size, 0].view(cache.dtype), kv_scale)


def _attend_row(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The `q.shape[0]` tokens at the last positions of a `seq_len` row, causally; `[n, H, Dl]` fp32."""
    n, heads, _ = q.shape
    out = torch.zeros(n, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    if seq_len <= 0 or n == 0:
        return out
    keys = _gather_row(cache, page_table_row, seq_len, kv_scale)  # [S, Dl+Dr]
    scores = torch.einsum("nhd,sd->nhs", q.float(), keys) * scale
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, None, :]
    visible = k_pos <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    # Tokens that see no key (length shorter than q_len) would softmax to NaN: they stay zero.
    sees_any = visible.any(-1).expand(n, heads)
    probs = torch.softmax(scores[sees_any], dim=-1)
    out[sees_any] = probs @ keys[:, :kv_lora_rank]
    return out


@register_kernel("mla", "write", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def mla_write_reference(
    latent_and_rope: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store rows `[T, Dl+Dr]` into `cache [pages, page_size, 1, Dl+Dr]` at flat slots; negative slots skipped.

    Skipping without a host sync: a padding row is redirected to the slot and
    value of the first real row (so duplicate writes agree), or, when no row
    is real, rewrites slot 0 with its own current value.
    """
    tokens = latent_and_rope.shape[0]
    if tokens == 0:
        return
    page_size = cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    # 1-element index tensors: indexing with a 0-dim tensor would read it on the host.
    first = torch.argmax(keep.to(torch.int32)).view(1)  # first real row, or 0 when there is none
    any_real = keep[first]
    index = torch.where(keep, torch.arange(tokens, device=slots.device), first)
    target = torch.where(keep, slots, torch.where(any_real, slots[first], 0))
    cached = byte_view(cache)  # fp8 through its bytes: see quant/fp8.byte_view
    values = byte_view(kv_for_cache(latent_and_rope, cache.dtype, kv_scale))[index]
    values = torch.where(any_real, values, cached[0, 0, 0].expand_as(values))
    cached[target // page_size, target % page_size, 0] = values


@register_kernel("mla", "decode", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q_len` query tokens per row (q `[rows * q_len, H, Dl+Dr]`) over the paged latent cache.

    `num_splits` only steers how fast kernels partition long contexts.
    """
    del num_splits
    out = torch.empty(*q.shape[:2], kv_lora_rank, dtype=q.dtype, device=q.device)
    for row, seq_len in enumerate(seq_lens.tolist()):
        tokens = slice(row * q_len, (row + 1) * q_len)
        out[tokens] = _attend_row(
            q[tokens], cache, page_table[row], seq_len, scale, kv_lora_rank, kv_scale
        ).to(q.dtype)
    return out


@register_kernel("mla", "extend", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def mla_extend_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
    max_query_len: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's new tokens attend to its cached prefix and, causally, to each other.

    `max_query_len` is only a launch hint for fast kernels.
    """
    del max_query_len
    starts = query_start.tolist()
    out = torch.zeros(*q.shape[:2], kv_lora_rank, dtype=q.dtype, device=q.device)
    for row, seq_len in enumerate(seq_lens.tolist()):
        tokens = slice(starts[row], starts[row + 1])
        out[tokens] = _attend_row(
            q[tokens], cache, page_table[row], seq_len, scale, kv_lora_rank, kv_scale
        ).to(q.dtype)
    return out
