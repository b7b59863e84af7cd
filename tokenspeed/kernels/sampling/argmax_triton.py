"""Triton greedy draw: each row's first argmax in one launch, the row split over many programs.

A greedy decode step ends with an argmax over the vocabulary (128K logits
for Llama-3). One program per row reads a row at one SM's rate; torch's
two-stage form (`reference.argmax_reference`: 64 chunk maxima, then their
argmax, a gather and index arithmetic) spreads the reads but costs five
launches, ~20 us of kernels a step at one row on an H200 (12.6 of them the
chunk maxima), most of it latency (`benchmarks/results/h200/fp8/2026-12-06b/call1/accept_e2e.fp8.profile.txt`).

Here a row is cut into CHUNK-wide pieces, one program each: every program
finds its piece's maximum and the first position holding it, stores that
pair, and counts its arrival on the row's counter
(`kernels/arrival_counters.py`); the row's last program to arrive reduces the
pairs in chunk order, so the first maximum of the row wins whatever the
arrival order, and writes the token. One launch, no host synchronisation,
no scratch beyond the pairs. On an H100 it took 22-24 us off a Llama-3.1-8B bs1 step, FP8 and bf16
alike (a 3.9 us kernel for the torch draw's five; `benchmarks/results/h100/wave2/argmax_2026-12-07/`).

Semantics are torch.argmax's: the first maximum; a NaN counts as larger
than every number (the first NaN wins); a row of -inf gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.arrival_counters import arrival_counters
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.sampling.reference import argmax_reference
from tokenspeed.kernels.triton_launch import for_tensor, next_power_of_2

CHUNK = 4096  # logits a program: one load per thread of 8 warps (16 fp32 each), 32 programs for Llama-3's vocabulary
NUM_WARPS = 8


@triton.jit
def _first_max(values, positions, none):
    """(maximum, first position holding it) of a block; NaN above everything; `none` where positions are masked."""
    is_nan = values != values
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), values), 0)
    hit = tl.where(any_nan, is_nan, values == best)
    first = tl.min(tl.where(hit, positions, none), 0)
    return tl.where(any_nan, float("nan"), best), first


@triton.jit
def _argmax_kernel(
    logits_ptr,
    stride_row,
    best_ptr,
    first_ptr,
    counters_ptr,
    out_ptr,
    vocab,
    CHUNKS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    in_row = offs < vocab
    values = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=in_row, other=float("-inf"))
    # masked lanes hold -inf and sit past every real position, so they never win a tie
    best, first = _first_max(values.to(tl.float32), offs, vocab)
    last = True
    if CHUNKS > 1:
        tl.store(best_ptr + row * CHUNKS + chunk, best)
        tl.store(first_ptr + row * CHUNKS + chunk, first)
        tl.debug_barrier()  # the pair is written before the arrival is counted (release)
        last = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1
        if last:
            parts = tl.arange(0, CHUNKS_P2)
            have = parts < CHUNKS
            bests = tl.load(best_ptr + row * CHUNKS + parts, mask=have, other=float("-inf"), cache_modifier=".cg")
            firsts = tl.load(first_ptr + row * CHUNKS + parts, mask=have, other=vocab, cache_modifier=".cg")
            # chunks are in position order, so the first chunk holding the maximum holds its first position
            _, winner = _first_max(bests, parts, CHUNKS)
            first = tl.sum(tl.where(parts == winner, firsts, 0), 0)
            tl.atomic_xchg(counters_ptr + row, 0)  # ready for the next launch
    if last:
        tl.store(out_ptr + row, first.to(tl.int64))


@register_kernel("sampling", "argmax", name="triton", band=Band.PORTABLE, platforms=("cuda",))
def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """int64 `[rows]`: the first argmax of each row of `logits` `[rows, vocab]` (any float dtype)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    counters = arrival_counters(logits.device, rows)
    if counters is None:  # none to be had (inside a first capture, or too many rows)
        return argmax_reference(logits)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    best = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
    first = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    for_tensor(_argmax_kernel, logits)[(rows, chunks)](
        logits, logits.stride(0), best, first, counters, out, vocab,
        CHUNKS=chunks, CHUNK_SIZE=CHUNK, CHUNKS_P2=next_power_of_2(chunks), num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
