"""Weight tiles through the tensor memory accelerator (TMA), for the streaming FP8 decode kernels.

A decode GEMV or skinny GEMM is a stream of weight tiles. Loaded by pointers,
every thread issues its own 16-byte copies and computes their addresses; with
a TMA descriptor one thread asks for the whole `[rows, K]` box, the pipeline
waits on an mbarrier, and out-of-range parts arrive as zeros. The pipeline's
stages then cost shared memory but no copy instructions, so a kernel can keep
more steps in flight for the same issue slots. Launch shapes opt in
(`Fp8GemvConfig.tma`, `SkinnyConfig.tma`); a weight the copy engine cannot
address (`tma_fits`) takes the pointer loads at the same shape.

The descriptor is built on the host for each launch (a few microseconds of
Python, nothing on the device) and passed by value, so a CUDA graph keeps it;
Triton's interpreter runs it on the CPU too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tokenspeed.kernels.gemm.gemv_triton import load_rows

_MAX_BOX = 256  # values a side of a TMA box


def tma_fits(weight: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Whether `weight`'s `[block_n, block_k]` tiles can come through a TMA descriptor (the copy engine's
    limits): a 16-byte aligned base and row stride, a box of at most 256 values a side, contiguous rows,
    and on a GPU Hopper or later."""
    fits = (weight.dim() == 2 and weight.stride(1) == 1 and weight.data_ptr() % 16 == 0
            and (weight.stride(0) * weight.element_size()) % 16 == 0 and max(block_n, block_k) <= _MAX_BOX)
    return fits and (not weight.is_cuda or torch.cuda.get_device_capability(weight.device)[0] >= 9)


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int, wanted: bool) -> TensorDescriptor | None:
    """The descriptor of `weight`'s `[block_n, block_k]` tiles where a launch shape wants TMA (`wanted`) and
    the weight fits; None: the kernel loads by pointers."""
    if wanted and tma_fits(weight, block_n, block_k):
        return TensorDescriptor.from_tensor(weight, [block_n, block_k])
    return None


@triton.jit
def load_weight_tile(rows, w_desc, row0, k0, offs_k, n_mask, K: tl.constexpr, EVEN: tl.constexpr,
                     USE_TMA: tl.constexpr):
    """Weight rows `row0`.. at columns `k0 + offs_k`: one TMA copy of the box with USE_TMA (zeros past the
    weight's edges; rows past a kernel's N are loaded but never stored), else `load_rows` at `rows`."""
    if USE_TMA:
        tile = w_desc.load([row0, k0])
    else:
        tile = load_rows(rows, k0 + offs_k, n_mask, K, EVEN)
    return tile
