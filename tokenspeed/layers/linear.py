"""Linear layers, plain and fused.

Fused projections (q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`)
turn three or two GEMMs into one, which matters most at decode batch sizes
where each GEMM is bandwidth-bound. Checkpoints store the parts separately, so
a fused layer knows its shards by name and `load_shard` writes each part into
its slice; the loader never needs to know the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
