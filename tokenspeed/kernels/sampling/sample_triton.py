"""Triton batched sampler: min-p / top-k / top-p filtering without sorting the vocabulary.

Sorting 150K logits per row costs more than the rest of sampling together.
Every filter here keeps an *upper set* of the probabilities, `{q >= t}` for a
threshold t, so we search for t instead of sorting:
- q_i = exp((l_i - max) / T) lies in [0, 1], and for non-negative floats the
  int32 bit pattern orders like the value, so t is searched over integers;
- each pass over the row tests 16 candidate thresholds at once (count of
  survivors for top-k, their mass for top-p), cutting the interval 17-fold,
  so about 8 passes find the exact threshold, with no scratch memory;
- min-p needs no search (q >= min_p, as max q is 1); top-k then searches among
  min-p survivors and top-p among top-k survivors, as the reference orders them.
Ties at the threshold are all kept (the sort-based reference keeps the ones the
sort happens to put first); otherwise the kept set is the reference's.

The draw is an exponential race: argmax of q_i / E_i over kept tokens, E_i
from Philox keyed by the row's key and the token id, so a key always yields
the same token and P(token i) is proportional to q_i, as in the reference.
One program per row; greedy rows (temperature < 1e-5) take the first argmax.
After the first passes the candidates sit in a few blocks of the vocabulary
(LLM distributions are peaked), so a pass does the 16-way work, and the draw
its Philox numbers, only in blocks that hold a candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.sampling.keys import mix_seeds
from tokenspeed.kernels.triton_launch import for_tensor, next_power_of_2
from tokenspeed.scheduler.sampling_params import GREEDY_EPSILON

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr, so the kernel may read it
_ONE_BITS = 0x3F800000  # bit pattern of 1.0f, the largest q


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    out_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    threshold_ptr,
    vocab,
    greedy_epsilon,
    ONE_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
    DRAW: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)

    # Pass 1: max logit and its first index (the greedy answer).
    best = tl.max(tl.full([BLOCK], float("-inf"), dtype=tl.float32), 0)
    best_idx = tl.sum(offs * 0, 0)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        logit = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(logit, 0)
        block_idx = start + tl.argmax(logit, 0, tie_break_left=True)
        better = block_best > best
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)

    temperature = tl.load(temperature_ptr + row)
    if temperature >= greedy_epsilon:
        factor = LOG2E / temperature
        probe = tl.arange(0, PROBES)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        threshold = min_p.to(tl.int32, bitcast=True)  # q >= min_p  <=>  bits(q) >= bits(min_p)

        top_k = tl.load(top_k_ptr + row)
        if (top_k > 0) & (top_k < vocab):
            # Largest t >= threshold with count(bits >= t) >= top_k.
            lo = threshold
            hi = threshold * 0 + ONE_BITS + 1
            while hi - lo > 1:
                step = tl.maximum((hi - lo) // (PROBES + 1), 1)
                cand = lo + step * (probe + 1)
                counts = tl.zeros([PROBES], dtype=tl.int32)
                for start in range(0, vocab, BLOCK):
                    idx = start + offs
                    logit = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                    bits = tl.exp2((logit - best) * factor).to(tl.int32, bitcast=True)
                    if tl.max(bits, 0) >= lo + step:  # else no token here reaches a candidate
                        counts += tl.sum((bits[:, None] >= cand[None, :]).to(tl.int32), 0)
                ok = (counts >= top_k) & (cand < hi)
                bad = (counts < top_k) & (cand < hi)
                lo = tl.maximum(lo, tl.max(tl.where(ok, cand, lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(bad, cand, hi), 0))
            threshold = lo

        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if top_p < 1.0:
            total = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                logit = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                q = tl.exp2((logit - best) * factor)
                bits = q.to(tl.int32, bitcast=True)
                if tl.max(bits, 0) >= threshold:
                    total += tl.sum(tl.where(bits >= threshold, q, 0.0), 0)
            target = top_p * total
            # Largest t >= threshold with mass(bits >= t) >= top_p * total.
            lo = threshold
            hi = threshold * 0 + ONE_BITS + 1
            while hi - lo > 1:
                step = tl.maximum((hi - lo) // (PROBES + 1), 1)
                cand = lo + step * (probe + 1)
                mass = tl.zeros([PROBES], dtype=tl.float32)
                for start in range(0, vocab, BLOCK):
                    idx = start + offs
                    logit = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                    q = tl.exp2((logit - best) * factor)
                    bits = q.to(tl.int32, bitcast=True)
                    if tl.max(bits, 0) >= lo + step:
                        mass += tl.sum(tl.where(bits[:, None] >= cand[None, :], q[:, None], 0.0), 0)
                ok = (mass >= target) & (cand < hi)
                bad = (mass < target) & (cand < hi)
                lo = tl.maximum(lo, tl.max(tl.where(ok, cand, lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(bad, cand, hi), 0))
            threshold = lo

        if DRAW:
            # Exponential race among kept tokens.
            key = tl.load(keys_ptr + row)
            best_score = tl.max(tl.full([BLOCK], -1.0, dtype=tl.float32), 0)
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                logit = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                q = tl.exp2((logit - best) * factor)
                keep = (q.to(tl.int32, bitcast=True) >= threshold) & (q > 0.0) & (idx < vocab)
                if tl.max(keep.to(tl.int32), 0) > 0:  # Philox only where a token is kept
                    race = -tl.log(tl.rand(key, idx))
                    score = tl.where(keep, q / race, -1.0)
                    block_best = tl.max(score, 0)
                    block_idx = start + tl.argmax(score, 0, tie_break_left=True)
                    better = block_best > best_score
                    best_idx = tl.where(better, block_idx, best_idx)
                    best_score = tl.where(better, block_best, best_score)
        else:
            tl.store(threshold_ptr + row, threshold)
    if DRAW:
        tl.store(out_ptr + row, best_idx.to(tl.int64))


def _launch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    out: torch.Tensor,
    thresholds: torch.Tensor,
    draw: bool,
) -> None:
    rows, vocab = logits.shape
    for_tensor(_sample_kernel, logits)[(rows,)](
        logits,
        logits.stride(0),
        out,
        temperature.to(torch.float32),
        top_k.to(torch.int32),
        top_p.to(torch.float32),
        min_p.to(torch.float32),
        keys,
        thresholds,
        vocab,
        GREEDY_EPSILON,
        ONE_BITS=_ONE_BITS,
        BLOCK=min(1024, next_power_of_2(vocab)),
        PROBES=16,
        DRAW=draw,
        num_warps=8,
    )


@register_kernel("sampling", "sample", name="triton", band=Band.PORTABLE, platforms=("cuda",))
def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row of logits `[rows, vocab]` (same contract as `sample_reference`).

    All parameters are `[rows]` device tensors (temperature/top_p/min_p float32,
    top_k int32, seeds/sample_indices int64), so the call never syncs with the
    host and can be captured in a CUDA graph. Returns int64 `[rows]`.
    """
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        keys = mix_seeds(seeds, sample_indices)
        _launch(logits, temperature, top_k, top_p, min_p, keys, out, out, draw=True)
    return out


def kept_threshold_bits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Per row, the int32 bit pattern t such that the sampler keeps exactly the tokens with
    bits(exp((logit - max) / temperature)) >= t. Exposed to test the threshold search on its own."""
    thresholds = torch.zeros(logits.shape[0], dtype=torch.int32, device=logits.device)
    if logits.shape[0]:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        unused = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        _launch(logits, temperature, top_k, top_p, min_p, unused, unused, thresholds, draw=False)
    return thresholds
