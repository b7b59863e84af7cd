"""FP8 (e4m3) formats and their torch reference: scales, quantisation, dequantisation.

One rounding rule everywhere: a value is multiplied by the reciprocal of its
scale (the reciprocal rounded once, in fp32), clamped to +-448 and rounded
to the nearest e4m3 value, ties to even. The Triton kernels follow it to the
bit (`fp8_cast.py`), so the tests compare fp8 codes exactly.

Formats, as the checkpoints and the kernels use them:

- **activations, dynamic per token group** (`quantize_per_token_group`):
  every token's row is cut into groups of 128 values, each with its own fp32
  scale = amax / 448 (DeepSeek-V3's recipe). Scales are `[..., ceil(K / 128)]`.
  `quantize_per_token`: one group spanning the row (scales `[..., 1]`), the
  activations of a rowwise-scaled GEMM (per-channel weights, cuBLAS).
- **weights, block scales** (`quantize_weight_block`, `dequantize_weight`):
  `weight [N, K]` fp8 and `scale [ceil(N / bn), ceil(K / bk)]` fp32, and
  w = w_fp8 * scale[n // bn, k // bk]: DeepSeek-V3/R1, Kimi-K2 and
  Qwen3-*-FP8 publish `weight_scale_inv` this way with `block_size` (128, 128).
  A block at least as large as the weight is clipped to it: per-output-channel
  scales are the block (1, K) or `PER_CHANNEL_BLOCK` (scale `[N, 1]`), a
  per-tensor scale the block (N, K); all kernels take the same `block_size`.
- **KV cache, static per-head scales** (`quantize_kv`, `dequantize_kv`): see
  `kv_scale_layout` (a scale per kv head, or one for all heads).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The activation group and the checkpoints' weight block (DeepSeek-V3, Kimi-K2, Qwen3-FP8).
GROUP_SIZE = 128
WEIGHT_BLOCK = (128, 128)
# Per-output-channel scales as a block: one row by any K (so one `block_size` serves w13 and w2 of experts).
PER_CHANNEL_BLOCK = (1, 2**31 - 1)
# An all-zero group still gets a positive scale, so its reciprocal stays finite.
MIN_AMAX = 1e-10

BlockSize = tuple[int, int]


def scales_whole_rows(block_size: BlockSize, k: int) -> bool:
    """Whether a block spans the rows' whole K (per-channel or per-tensor scales): the kernels then scale each
    row's finished sum instead of each K group's products."""
    return block_size[1] >= k


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes), others unchanged.

    torch's indexing kernels (`index`, `index_put_`, `where`, `index_select`)
    do not take fp8 on every build and device; the references gather and
    scatter cached fp8 values through this view instead.
    """
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e4m3, saturating at +-448 (torch's cast alone would give NaN above it on some builds)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale mapping `amax` onto the largest fp8 value (amax / 448, at least MIN_AMAX / 448).

    Divided by a tensor, not a Python number: torch's CUDA division by a
    scalar multiplies by its rounded reciprocal, one ulp off the correctly
    rounded quotient the CPU and the Triton kernels compute.
    """
    amax = amax.float().clamp(min=MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x `[..., K]` as fp32 `[..., ceil(K / g), g]`, the tail group padded with zeros."""
    k = x.shape[-1]
    pad = -k % group_size
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.view(*x.shape[:-1], (k + pad) // group_size, group_size)


def quantize_per_token_group(
    x: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., K]` -> (fp8 `[..., K]`, fp32 scales `[..., ceil(K / group_size)]`), scale = group amax / 448."""
    groups = _groups(x, group_size)
    scales = scale_of(groups.abs().amax(dim=-1))
    q = cast_to_fp8(groups * torch.reciprocal(scales)[..., None])
    return q.flatten(-2)[..., : x.shape[-1]], scales


register_kernel(
    "quant",
    "per_token_group",
    name="reference",
    band=Band.REFERENCE,
    platforms=("cpu", "cuda"),
    impl=quantize_per_token_group,
)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., K]` -> (fp8 `[..., K]`, fp32 scales `[..., 1]`): one group spanning the row (rowwise scaling)."""
    return quantize_per_token_group(x, group_size=max(x.shape[-1], 1))


register_kernel(
    "quant", "per_token", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"), impl=quantize_per_token
)


def dequantize_per_token_group(
    q: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_per_token_group`: q * scale of its group, in `dtype`."""
    expanded = scales.float().repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]
    return (q.float() * expanded).to(dtype)


def check_weight_scale(weight: torch.Tensor, scale: torch.Tensor, block_size: BlockSize) -> None:
    """Raise ValueError unless `scale` has one fp32 entry per `block_size` block of a 2-D fp8 `weight`."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be a 2-D {FP8_DTYPE} tensor, got {weight.dtype} {tuple(weight.shape)}")
    bn, bk = block_size
    if bn < 1 or bk < 1:
        raise ValueError(f"block_size {block_size} must be positive")
    n, k = weight.shape
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(
            f"scale for a {n}x{k} weight in {bn}x{bk} blocks must be float32 {want}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )


def _clip(block_size: BlockSize, n: int, k: int) -> BlockSize:
    """The block within an `n x k` weight (a block larger than the weight covers all of it)."""
    return min(block_size[0], max(n, 1)), min(block_size[1], max(k, 1))


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block_size: BlockSize) -> torch.Tensor:
    """Per-block scales `[..., ceil(N/bn), ceil(K/bk)]` repeated to one per element `[..., N, K]`."""
    bn, bk = _clip(block_size, *shape)
    rows = scale.repeat_interleave(bn, dim=-2)[..., : shape[0], :]
    return rows.repeat_interleave(bk, dim=-1)[..., : shape[1]]


def weight_block_amax(weight: torch.Tensor, block_size: BlockSize = WEIGHT_BLOCK) -> torch.Tensor:
    """The largest |value| of every `block_size` block of `weight [..., N, K]`: fp32 `[..., ceil(N/bn), ceil(K/bk)]`."""
    n, k = weight.shape[-2:]
    bn, bk = _clip(block_size, n, k)
    pad_n, pad_k = -n % bn, -k % bk
    w = torch.nn.functional.pad(weight.float(), (0, pad_k, 0, pad_n))
    blocks = w.view(*weight.shape[:-2], (n + pad_n) // bn, bn, (k + pad_k) // bk, bk)
    return blocks.abs().amax(dim=(-3, -1))


def quantize_weight_block(
    weight: torch.Tensor, block_size: BlockSize = WEIGHT_BLOCK, *, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantisation of `weight [..., N, K]` (leading dims: experts): (fp8, fp32 scales per block).

    Each block's scale maps its amax onto 448, so no value saturates.
    `block_size` (1, K) gives per-output-channel scales `[N, 1]`. `amax` (per
    block, as `weight_block_amax` gives it) replaces the weight's own: a rank
    holding part of each row quantises with the whole row's amax, as one rank would.
    """
    n, k = weight.shape[-2:]
    scales = scale_of(weight_block_amax(weight, block_size) if amax is None else amax)
    q = cast_to_fp8(weight.float() * _expand_blocks(torch.reciprocal(scales), (n, k), block_size))
    return q, scales


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight_block` with one scale per output row (`PER_CHANNEL_BLOCK`): (fp8, fp32 `[..., N, 1]`)."""
    return quantize_weight_block(weight, PER_CHANNEL_BLOCK)


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, block_size: BlockSize, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w_fp8 * scale[n // bn, k // bk] in `dtype`, for `[..., N, K]` weights and `[..., N/bn, K/bk]` scales."""
    expanded = _expand_blocks(scale.float(), tuple(weight.shape[-2:]), block_size)  # type: ignore[arg-type]
    return (weight.float() * expanded).to(dtype)


def kv_scale_layout(scale: torch.Tensor, kv_heads: int) -> int:
    """Stride of a KV-cache scale tensor over kv heads: 1 for one scale per head, 0 for one for all.

    Why per head: a program of every attention kernel serves one kv head, so
    its scale is a constant there; dequantisation folds into the softmax scale
    (keys) and the output normalisation (values) and the inner loop only
    widens fp8 to the query dtype. So per-head scales cost nothing over one
    scale, and take calibrated per-head scales where a checkpoint has them;
    one scale for all heads (vLLM's per-tensor `k_scale`) is the special case
    of shape `[1]`. (With e4m3's ~2^15 range, one scale loses precision only
    on heads a few hundred times smaller than the largest.) Scales are static
    (fixed for the cache's life, 1.0 unless a checkpoint or calibration gives them):
    a cached value is never rescaled.
    """
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() not in (1, kv_heads):
        raise ValueError(
            f"kv scale must be float32 of shape [{kv_heads}] or [1], got {scale.dtype} {tuple(scale.shape)}"
        )
    if not scale.is_contiguous():
        raise ValueError("kv scale must be contiguous")
    return 0 if scale.numel() == 1 else 1


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    """`[heads]` or `[1]` scales shaped to broadcast over rows `[..., heads, dim]`."""
    return scale.float().view(-1, 1)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K/V rows `[..., heads, dim]` -> fp8 with a static scale per head (`[heads]`) or for all (`[1]`)."""
    return cast_to_fp8(x.float() * torch.reciprocal(_per_head(scale)))


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows `[..., heads, dim]` as fp32; fp8 rows are multiplied by their head's scale."""
    if scale is None:
        return x.float()
    return x.float() * _per_head(scale)


def kv_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """K/V rows `[..., heads, dim]` as a cache of `cache_dtype` stores them.

    An fp8 cache quantises them with `scale` (None: 1.0); any other cache casts
    them, and refuses a scale (it would be silently ignored).
    """
    if cache_dtype == FP8_DTYPE:
        return cast_to_fp8(x) if scale is None else quantize_kv(x, scale)
    if scale is not None:
        raise ValueError(f"kv scales apply to {FP8_DTYPE} caches, not {cache_dtype}")
    return x.to(cache_dtype)


def kv_scale_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, cache: torch.Tensor, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
    """(k scale pointer, v scale pointer, HAS_SCALE, SCALE_STRIDE) of a Triton KV kernel.

    Scales come both or neither (the cache stands in for missing ones), only
    for an fp8 cache, each `[kv_heads]` or `[1]` (`kv_scale_layout`).
    """
    if k_scale is None and v_scale is None:
        return cache, cache, False, 0
    if k_scale is None or v_scale is None or k_scale.numel() != v_scale.numel():
        raise ValueError("give k_scale and v_scale together, of the same shape")
    if cache.dtype != FP8_DTYPE:
        raise ValueError(f"kv scales apply to {FP8_DTYPE} caches, not {cache.dtype}")
    kv_scale_layout(v_scale, kv_heads)
    return k_scale, v_scale, True, kv_scale_layout(k_scale, kv_heads)
