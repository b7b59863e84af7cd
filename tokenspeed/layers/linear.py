"""Linear layers, plain and fused.

Fused projections (q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`)
turn three or two GEMMs into one, which matters most at decode batch sizes
where each GEMM is bandwidth-bound. Checkpoints store the parts separately, so
a fused layer knows its shards by name and `load_shard` writes each part into
its slice; the loader never needs to know the layout.

At decode batch sizes (a few tokens) a projection is a pure weight stream, and
a GEMV kernel (`gemm.decode`, chosen once at build time through the registry)
reads the weights faster than cuBLAS's split-K GEMMs and needs no reduction
kernel. Per call the only Python left is one comparison of the token count
with the most tokens that kernel serves (-1 when only the reference fits, so
`--kernel gemm.decode=reference` restores plain `F.linear`). Inputs are
`[tokens, in_features]`, as every layer of the engine passes them.

FP8 weights (`use_fp8`, see `fp8_weights.py`): the weight is e4m3 with
`weight_scale_inv` per `fp8_block`, and every call goes through `gemm.fp8`
(the one-token GEMV or the tensor-core GEMMs by token count; the reference
dequantises on the fly, which is the CPU path and the off switch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.kernels.gemm import DECODE_MAX_TOKENS, FP8_FUSED_DECODE_MAX_TOKENS
from tokenspeed.kernels.gemm.fp8_dispatch import Fp8GemmByBatch, select_fp8_gemm_by_batch
from tokenspeed.kernels.quant.fp8 import BlockSize
from tokenspeed.kernels.registry import Band, platform_of, select_kernel
from tokenspeed.layers.fp8_weights import (
    AmaxReduce,
    load_scale_part,
    make_fp8_storage,
    quantize_in_place,
    weight_dtype,
)

DecodeGemm = Callable[..., torch.Tensor]


def select_decode_kernel(
    family: str, mode: str, *, device: torch.device | str, dtype: torch.dtype, max_tokens: int
) -> tuple[DecodeGemm | None, int]:
    """(kernel, most tokens it serves) for `family.mode` at decode sizes (up to `max_tokens`), or
    (None, -1) when only the reference fits.

    The reference is the oracle and the off switch, never a fast path: a layer
    that gets it keeps its ordinary (cuBLAS / torch) code.
    """
    spec = select_kernel(
        family, mode, platform=platform_of(device), dtype=dtype, workload={"num_tokens": (1, max_tokens)}
    )
    if spec.band == Band.REFERENCE:
        return None, -1
    return spec.impl, spec.workload.get("num_tokens", (1, max_tokens))[1]


def select_decode_gemm(
    mode: str, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[DecodeGemm | None, int]:
    """`select_decode_kernel` for `gemm.<mode>`, up to `DECODE_MAX_TOKENS`."""
    return select_decode_kernel("gemm", mode, device=device, dtype=dtype, max_tokens=DECODE_MAX_TOKENS)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), with W `[out_features, in_features]` as in HF checkpoints."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param(out_features, in_features, dtype=weight_dtype(dtype), device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self._decode_gemm, self._decode_max_tokens = select_decode_gemm("decode", device=device, dtype=dtype)
        self.register_parameter("weight_scale_inv", None)
        self.fp8_block: BlockSize | None = None  # the stored scales' block; None: not fp8
        self.checkpoint_block: BlockSize | None = None  # the checkpoint's block (its scale shapes)
        self._fp8_gemm: Fp8GemmByBatch | None = None
        self._dtype = dtype

    def use_fp8(
        self, block: BlockSize, *, checkpoint_block: BlockSize | None, reduce_amax: AmaxReduce | None = None
    ) -> None:
        """Make the weight fp8: empty storage to load into (`checkpoint_block` given: a serialized
        checkpoint's blocks), or the loaded weight quantised now (None: online quantisation; a rank
        holding part of each row passes `reduce_amax`, see `fp8_weights.AmaxReduce`)."""
        if checkpoint_block is None:
            quantize_in_place(self, "weight", block, reduce_amax)
        else:
            make_fp8_storage(self, "weight", block)
        self.fp8_block, self.checkpoint_block = block, checkpoint_block
        self._fp8_gemm = select_fp8_gemm_by_batch(platform=platform_of(self.weight.device), dtype=self._dtype)
        # The fused decode forms go on in the FP8 GEMV, unless they are off (`--kernel gemm.decode=reference`).
        fused = self._fp8_gemm.fused_decode if self._decode_gemm is not None else None
        self._decode_gemm = fused
        self._decode_max_tokens = FP8_FUSED_DECODE_MAX_TOKENS if fused is not None else -1

    def drop_fp8(self, weight: torch.Tensor) -> None:
        """Back to a plain weight (a dequantised one, for layers that read the weight itself: MLA's kv_b_proj)."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = None
        self.fp8_block = self.checkpoint_block = None
        self._fp8_gemm = None
        self._decode_gemm, self._decode_max_tokens = None, -1

    @property
    def decode_max_tokens(self) -> int:
        """Most tokens `forward_decode` serves (-1: no decode kernel, e.g. on the CPU)."""
        return self._decode_max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fp8_gemm is not None:
            scales, block = self.weight_scale_inv, self.fp8_block
            return self._fp8_gemm(x, self.weight, scales, block_size=block, bias=self.bias)  # type: ignore[arg-type]
        if x.shape[0] <= self._decode_max_tokens:
            return self._decode_gemm(x, self.weight, self.bias)  # type: ignore[misc]
        return F.linear(x, self.weight, self.bias)

    def forward_decode(
        self,
        x: torch.Tensor,
        *,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[rms_norm(x)] W^T (+ b) [+ residual] in one decode kernel; only for `decode_max_tokens` or fewer rows."""
        if self._decode_gemm is None:
            raise RuntimeError("no decode GEMM kernel was selected for this layer")
        if self._fp8_gemm is not None:
            return self.fp8_decode(x, norm_weight=norm_weight, eps=eps, residual=residual)
        return self._decode_gemm(x, self.weight, self.bias, norm_weight=norm_weight, eps=eps, residual=residual)

    def fp8_decode(
        self,
        x: torch.Tensor,
        *,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        """The FP8 GEMV with the decode layer's fused forms (see `fp8_gemv_triton`); fp8 layers only."""
        if self._fp8_gemm is None or self._decode_gemm is None:
            raise RuntimeError("no fused FP8 decode kernel was selected for this layer")
        return self._decode_gemm(
            x, self.weight, self.weight_scale_inv, block_size=self.fp8_block, bias=self.bias,
            norm_weight=norm_weight, eps=eps, residual=residual, silu_mul=silu_mul,
        )  # fmt: skip

    def extra_repr(self) -> str:
        fp8 = f", fp8 block={self.fp8_block}" if self.fp8_block is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fp8}"


class MergedLinear(Linear):
    """Several linears sharing one input, concatenated along the output axis in declared order."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype, device=device)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(self.shard_offsets)

    @property
    def part_sizes(self) -> list[int]:
        return [size for _, size in self.shard_offsets.values()]

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy one part (e.g. `weight` of shard `k`) into its slice of the fused parameter."""
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise KeyError(f"{type(self).__name__} has no parameter {param_name!r}")
        if shard not in self.shard_offsets:
            raise KeyError(f"unknown shard {shard!r}; shards: {', '.join(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard]
        if param_name == "weight_scale_inv" and self.fp8_block is not None and self.checkpoint_block is not None:
            load_scale_part(param.data, tensor, offset=offset, size=size, in_features=self.in_features,
                            block=self.fp8_block, checkpoint_block=self.checkpoint_block, what=f"shard {shard!r}")
            return
        target = param.data.narrow(0, offset, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard!r} of {param_name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)

    def split_output(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split([size for _, size in self.shard_offsets.values()], dim=-1))


class QKVLinear(MergedLinear):
    """Fused q/k/v projection for grouped-query attention: shards `q`, `k`, `v`."""

    def __init__(
        self,
        hidden_size: int,
        *,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        kv = num_kv_heads * head_dim
        super().__init__(
            hidden_size, {"q": num_heads * head_dim, "k": kv, "v": kv}, bias=bias, dtype=dtype, device=device
        )


class GateUpLinear(MergedLinear):
    """Fused gate/up projection of a gated MLP: shards `gate` then `up` (the layout silu_and_mul expects)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(
            hidden_size,
            {"gate": intermediate_size, "up": intermediate_size},
            bias=bias,
            dtype=dtype,
            device=device,
        )
