"""`sampling.bitmask` in Triton: one program per (masked row, block of the vocabulary).

Each program reads its block's mask words once (a block of 1024 tokens is 32
words), expands the bits in registers and writes -inf over the disallowed
logits; allowed logits are not written at all, so the kernel moves about one
pass of the masked rows' logits and nothing of the other rows. Row indices
and the mask stay on the device: no host synchronisation, CUDA-graph safe.
Same contract as `bitmask_reference.apply_bitmask_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import for_tensor

_BLOCK = 1024


@triton.jit
def _bitmask_kernel(logits_ptr, stride_row, bitmask_ptr, num_words, indices_ptr, vocab, BLOCK: tl.constexpr):
    entry = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(indices_ptr + entry)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    word = tokens // 32
    words = tl.load(bitmask_ptr + entry.to(tl.int64) * num_words + word, mask=word < num_words, other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    base = logits_ptr + row.to(tl.int64) * stride_row
    tl.store(base + tokens, tl.full([BLOCK], float("-inf"), tl.float32), mask=(tokens < vocab) & ~allowed)


@register_kernel("sampling", "bitmask", name="triton", band=Band.PORTABLE, platforms=("cuda",))
def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """In place: logits rows `indices` `[n]` (int64) masked by `bitmask` `[n, words]` (int32); float32 logits
    with unit stride along the vocabulary (the sampler's)."""
    n = indices.numel()
    if not n:
        return
    if logits.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError("apply_bitmask_triton takes float32 logits with unit stride along the vocabulary")
    vocab = logits.shape[1]
    bitmask = bitmask.to(torch.int32).contiguous()
    grid = (n, triton.cdiv(vocab, _BLOCK))
    for_tensor(_bitmask_kernel, logits)[grid](
        logits, logits.stride(0), bitmask, bitmask.shape[1], indices, vocab, BLOCK=_BLOCK
    )
