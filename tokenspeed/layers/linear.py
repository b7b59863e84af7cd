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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.kernels.gemm import DECODE_MAX_TOKENS
from tokenspeed.kernels.registry import Band, platform_of, select_kernel

DecodeGemm = Callable[..., torch.Tensor]


def select_decode_gemm(
    mode: str, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[DecodeGemm | None, int]:
    """(kernel, most tokens it serves) for `gemm.<mode>`, or (None, -1) when only the reference fits.

    The reference is the oracle and the off switch, never a fast path: a layer
    that gets it keeps its ordinary (cuBLAS / torch) code.
    """
    spec = select_kernel(
        "gemm",
        mode,
        platform=platform_of(device),
        dtype=dtype,
        workload={"num_tokens": (1, DECODE_MAX_TOKENS)},
    )
    if spec.band == Band.REFERENCE:
        return None, -1
    return spec.impl, spec.workload.get("num_tokens", (1, DECODE_MAX_TOKENS))[1]


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
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self._decode_gemm, self._decode_max_tokens = select_decode_gemm("decode", device=device, dtype=dtype)

    @property
    def decode_max_tokens(self) -> int:
        """Most tokens `forward_decode` serves (-1: no decode kernel, e.g. on the CPU)."""
        return self._decode_max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        return self._decode_gemm(x, self.weight, self.bias, norm_weight=norm_weight, eps=eps, residual=residual)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


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

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy one part (e.g. `weight` of shard `k`) into its slice of the fused parameter."""
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise KeyError(f"{type(self).__name__} has no parameter {param_name!r}")
        if shard not in self.shard_offsets:
            raise KeyError(f"unknown shard {shard!r}; shards: {', '.join(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard]
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
