"""FP8 weights of one layer: storage, block layout, quantise / dequantise in place, dummy values.

A weight `X` (`weight` of a `Linear`, `w13`/`w2` of stacked experts) becomes
fp8 e4m3 of the same shape, and its fp32 scales the parameter `X_scale_inv`
(the checkpoints' `weight_scale_inv`; "inv" because w = w_fp8 * scale, the
inverse of the quantisation multiplier), one per `fp8_block` block.

Layout of fused weights: checkpoints scale each part (q, k, v; gate, up) in
its own 128 x 128 blocks. Stacked into one weight those blocks stay blocks
only when every part but the last starts on a block row; otherwise (tiny
models, 576-row MLA parts in the middle) the scales are stored per output row
(`fp8_block` (1, bk)), each row holding its block's scale, which every
`gemm.fp8` / `moe.experts_fp8` kernel takes (cuBLAS only the aligned form).
`checkpoint_block` keeps the checkpoint's own block for loading and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from tokenspeed.kernels.quant.fp8 import (
    FP8_DTYPE,
    PER_CHANNEL_BLOCK,
    BlockSize,
    dequantize_weight,
    quantize_weight_block,
    weight_block_amax,
)

SCALE_SUFFIX = "_scale_inv"

# Online quantisation over ranks: this rank's per-block amax of a weight whose input features are split
# (o_proj, down_proj, experts' w2) -> the whole rows' amax (models/parallel/fp8_sharding.py).
AmaxReduce = Callable[[torch.Tensor], torch.Tensor]

# While a model for a serialized FP8 checkpoint is built, its projection weights are allocated in fp8:
# a bf16 copy first would need twice the weights' memory at once (122 GB for deepseek-v3-fp8-8l).
_BUILDING_FP8: ContextVar[bool] = ContextVar("building_fp8", default=False)


@contextmanager
def fp8_weight_allocation(enabled: bool) -> Iterator[None]:
    """Within it (enabled), `weight_dtype` gives fp8: layers allocate their big weights at one byte."""
    token = _BUILDING_FP8.set(enabled)
    try:
        yield
    finally:
        _BUILDING_FP8.reset(token)


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a `Linear` / stacked experts weight is allocated in (see `fp8_weight_allocation`)."""
    return FP8_DTYPE if _BUILDING_FP8.get() else dtype


def restore_dtype(module: nn.Module, attr: str, dtype: torch.dtype) -> None:
    """A weight allocated in fp8 at build that stays unquantised: allocate it again in `dtype`."""
    weight = getattr(module, attr)
    if weight.dtype == FP8_DTYPE and dtype != FP8_DTYPE:
        module.register_parameter(attr, _param(torch.empty(weight.shape, dtype=dtype, device=weight.device)))


def stored_block(part_sizes: list[int], checkpoint_block: BlockSize) -> BlockSize:
    """The block the fused weight of `part_sizes` rows keeps: the checkpoint's, or per row if parts misalign."""
    bn, bk = checkpoint_block
    if all(size % bn == 0 for size in part_sizes[:-1]):
        return checkpoint_block
    return 1, bk


def scale_shape(weight_shape: tuple[int, ...], block: BlockSize) -> tuple[int, ...]:
    """Scales of a `[..., N, K]` weight in `block` blocks (a block larger than the weight clips to it)."""
    *lead, n, k = weight_shape
    return (*lead, -(-n // min(block[0], n)), -(-k // min(block[1], k)))


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def make_fp8_storage(module: nn.Module, attr: str, block: BlockSize) -> None:
    """Replace `module.attr` by an empty fp8 weight of its shape and add its empty fp32 scales (for loading)."""
    weight = getattr(module, attr)
    module.register_parameter(attr, _param(torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)))
    scales = torch.empty(scale_shape(tuple(weight.shape), block), dtype=torch.float32, device=weight.device)
    module.register_parameter(attr + SCALE_SUFFIX, _param(scales))


def quantize_in_place(module: nn.Module, attr: str, block: BlockSize, reduce_amax: AmaxReduce | None = None) -> None:
    """Quantise the loaded `module.attr` to fp8 with scales per `block` (one expert at a time: bounded memory);
    `reduce_amax` completes the amax of a rank's part of each row (one collective for all experts)."""
    weight = getattr(module, attr).data
    rows = weight.view(-1, *weight.shape[-2:])
    amax = None
    if reduce_amax is not None:
        amax = reduce_amax(torch.stack([weight_block_amax(rows[i], block) for i in range(rows.shape[0])]))
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty((rows.shape[0], *scale_shape(tuple(rows.shape[1:]), block)), dtype=torch.float32,
                         device=weight.device)
    for i in range(rows.shape[0]):
        q[i], scales[i] = quantize_weight_block(rows[i], block, amax=None if amax is None else amax[i])
    module.register_parameter(attr, _param(q.view(weight.shape)))
    module.register_parameter(attr + SCALE_SUFFIX, _param(scales.view(scale_shape(tuple(weight.shape), block))))


def dequantize_in_place(module: nn.Module, attr: str, block: BlockSize, dtype: torch.dtype) -> None:
    """Turn a loaded fp8 `module.attr` back into a `dtype` weight and drop its scales (absorbed MLA weights)."""
    weight = getattr(module, attr)
    scales = getattr(module, attr + SCALE_SUFFIX)
    module.register_parameter(attr, _param(dequantize_weight(weight.data, scales.data, block, dtype)))
    module.register_parameter(attr + SCALE_SUFFIX, None)


def fill_dummy(module: nn.Module, attr: str, block: BlockSize, std: float, generator: torch.Generator) -> None:
    """Random fp8 weights: normal(0, std) per expert / matrix, quantised with their scales (dummy load format)."""
    weight = getattr(module, attr).data
    scales = getattr(module, attr + SCALE_SUFFIX).data
    rows = weight.view(-1, *weight.shape[-2:])
    flat_scales = scales.view(-1, *scales.shape[-2:])
    for i in range(rows.shape[0]):
        values = torch.empty(rows.shape[1:], dtype=torch.float32, device=weight.device)
        values.normal_(mean=0.0, std=std, generator=generator)
        rows[i], flat_scales[i] = quantize_weight_block(values, block)


def load_scale_part(
    scales: torch.Tensor,
    tensor: torch.Tensor,
    *,
    offset: int,
    size: int,
    in_features: int,
    block: BlockSize,
    checkpoint_block: BlockSize,
    what: str,
) -> None:
    """Copy the checkpoint scales of one part (rows `offset:offset+size` of the fused weight) into `scales`.

    `tensor` must be the part's own scales in the checkpoint's blocks; a stored
    per-row layout repeats each block's scale over its rows. ValueError otherwise.
    """
    cbn, cbk = checkpoint_block
    want = (-(-size // cbn), -(-in_features // cbk))
    if tuple(tensor.shape) != want:
        raise ValueError(
            f"{what}: weight_scale_inv of a {size}x{in_features} weight in {cbn}x{cbk} blocks must have "
            f"shape {want}, got {tuple(tensor.shape)}"
        )
    if block[0] == cbn:
        scales.narrow(0, offset // cbn, want[0]).copy_(tensor)
    else:
        scales.narrow(0, offset, size).copy_(tensor.repeat_interleave(cbn, dim=0)[:size])


def per_tensor_scale(tensor: torch.Tensor) -> float:
    """The value of a per-tensor scale (a weight's, an activation's, a KV cache's): one positive finite number.

    ValueError otherwise: a scale of 0, inf or NaN would turn what it scales into zeros or NaNs without a word.
    """
    if tensor.numel() != 1:
        raise ValueError(f"a per-tensor scale has one element, got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (0.0 < value < float("inf")):
        raise ValueError(f"a scale must be positive and finite, got {value}")
    return value


def per_channel_scales(tensor: torch.Tensor, rows: int, *, per_tensor: bool) -> torch.Tensor:
    """A checkpoint's scales of a `rows`-row weight, per tensor (one element) or per output channel (`[rows, 1]`),
    as the fp32 `[rows, 1]` scales of `PER_CHANNEL_BLOCK` that the layers hold.

    A per-tensor scale repeated over its weight's rows scales the same weight exactly, so the parts of a fused
    projection (or stacked experts) keep their own scales and nothing is requantised. ValueError for another
    shape, or a scale that is not positive and finite.
    """
    if per_tensor:
        return torch.full((rows, 1), per_tensor_scale(tensor), dtype=torch.float32)
    if tuple(tensor.shape) != (rows, 1):
        raise ValueError(
            f"per-channel scales of a {rows}-row weight have shape ({rows}, 1), got {tuple(tensor.shape)}"
        )
    scales = tensor.float()
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"scales must be positive and finite, got {scales[row, 0].item()} for row {row}")
    return scales


def online_block() -> BlockSize:
    """Online quantisation's block: one scale per output channel (see `models/quant_config.py`)."""
    return PER_CHANNEL_BLOCK
