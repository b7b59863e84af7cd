"""Triton building blocks shared by the paged decode and extend attention kernels.

Both kernels stream one row's keys/values in BLOCK_N positions at a time
through its page table and fold them into an online softmax; only how they
choose the key range and mask differs. Keeping the page gather and the
softmax update here means a fix or a tuning of either reaches both kernels.
The split-KV partials (`store_split_partial`, `merge_split_partials`) serve the
GQA and MLA decode kernels alike.
`@triton.jit` helpers are inlined at compile time, so this costs nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_kv_tile(cache_ptr, page, slot, kv_head, stride_p, stride_s, stride_h, offs_d, kv_mask):
    """Load `[BLOCK_N, BLOCK_D]` of one kv head at (page, slot) positions; masked lanes read 0."""
    rows = page * stride_p + slot * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """`tl.dot`, in exact fp32 (IEEE) when checking against the reference, else on tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one block of base-2 scores and its values into the running (max, sum, accumulator).

    A query row that sees no key in the block (all -inf: padding or a sliding
    window) keeps exp2 finite by shifting with 0 instead of -inf.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def store_split_partial(part_out_ptr, part_lse_ptr, part, row_mask, acc, m_i, l_i, offs_d, d_mask, DIM: tl.constexpr):
    """Store one split's rows `part` for `merge_split_partials`: the normalised `[DIM]` output and its base-2 lse.

    (m_i, l_i, acc) are the online-softmax state; a row that saw no key stores lse -inf.
    """
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    mask = row_mask[:, None] & d_mask[None, :]
    tl.store(part_out_ptr + part[:, None] * DIM + offs_d[None, :], acc / denom[:, None], mask=mask)
    tl.store(part_lse_ptr + part, tl.where(l_i > 0.0, m_i + tl.log2(denom), float("-inf")), mask=row_mask)


@triton.jit
def merge_split_partials(part_out_ptr, part_lse_ptr, base, offs_s, s_mask, offs_d, d_mask, DIM: tl.constexpr):
    """One (token, head)'s split-KV partials merged: each split's output weighted by exp2(lse - max lse).

    Splits `base + offs_s` hold a normalised `[DIM]` output and its base-2
    log-sum-exp (-inf: the split saw no key); returns the `offs_d` lanes, fp32.
    """
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    return tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
