"""Sparse mixture-of-experts block: router, stacked routed experts, optional shared experts.

One module serves Qwen3-MoE, Mixtral and DeepSeek-V2/V3 because `MoEConfig`
already reduced their routing to one vocabulary; what differs per model is
only the checkpoint spelling of the expert projections (`ExpertNames`).

Layout, chosen for the kernels rather than for the checkpoint:

- `gate` (`Router`): `weight` [E, H] and, for DeepSeek-V3, `e_score_correction_bias`
  [E] (HF keeps the bias on the gate module, so the checkpoint name
  `...mlp.gate.e_score_correction_bias` maps as is). Both are held in fp32 and
  the router logits are computed in fp32: top-k over nearly tied bf16 logits
  flips expert choices, and the [E, H] matrix is tiny next to the experts.
- `experts` (`StackedExperts`): `w13` [E, 2I, H] (rows :I gate, I: up) and
  `w2` [E, H, I], one tensor per projection for all experts, which is what a
  grouped GEMM reads. Checkpoints store one matrix per expert
  (`experts.{e}.gate_proj.weight`, Mixtral `experts.{e}.w1.weight`); the module
  maps those names onto (parameter, shard) itself, so the generic loader keeps
  checking missing and unexpected names. transformers v5 holds the same
  stacked layout in memory (`experts.gate_up_proj`, `experts.down_proj`), and
  those whole tensors load too.
- `shared_experts` (`GatedMLP` of `num_shared_experts * moe_intermediate_size`):
  DeepSeek's always-on experts, added to the routed output.

Routing and the expert GEMMs are resolved through the kernel registry at build
time (`moe.route`; `moe.experts` once for small and once for large batches, see
`kernels/moe/experts_dispatch.py`), like every other hot op.

FP8 experts (`SparseMoE.use_fp8`): `w13`/`w2` in e4m3 with `w13_scale_inv` /
`w2_scale_inv` (the per-expert `weight_scale_inv` of the checkpoint, stacked;
see `fp8_weights.py` for when they are kept per row), run by `moe.experts_fp8`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.kernels.moe import ROUTER_TRITON_MAX_TOKENS
from tokenspeed.kernels.moe.experts_dispatch import select_experts_by_batch
from tokenspeed.kernels.quant.fp8 import BlockSize
from tokenspeed.kernels.registry import platform_of, select_kernel
from tokenspeed.layers.fp8_weights import (
    SCALE_SUFFIX,
    AmaxReduce,
    load_scale_part,
    make_fp8_storage,
    quantize_in_place,
    weight_dtype,
)
from tokenspeed.layers.linear import select_decode_kernel
from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.placement.rank_context import current_rank_context

if TYPE_CHECKING:
    from tokenspeed.layers.moe_config import MoEConfig


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Checkpoint names of one expert's gate, up and down projections."""

    gate: str
    up: str
    down: str


QWEN_EXPERT_NAMES = ExpertNames("gate_proj", "up_proj", "down_proj")  # Qwen3-MoE, DeepSeek
MIXTRAL_EXPERT_NAMES = ExpertNames("w1", "w3", "w2")
# transformers v5's in-memory stacked tensors: whole-parameter names of w13 and w2.
_STACKED_NAMES = {"gate_up_proj": "w13", "down_proj": "w2"}


class Router(nn.Module):
    """Router logits in fp32: `weight` [E, H], plus DeepSeek-V3's choice-only correction bias.

    Decode-sized batches take `moe.router_logits` in one launch where a fast kernel is registered
    (`kernels/moe/router_logits_triton.py`); other batches, and the reference (the off switch),
    `F.linear` on x widened to fp32.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        *,
        correction_bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device), requires_grad=False
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device), requires_grad=False)
            if correction_bias
            else None
        )
        self._decode_logits, self._decode_max_tokens = select_decode_kernel(
            "moe", "router_logits", device=device, dtype=dtype, max_tokens=ROUTER_TRITON_MAX_TOKENS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._decode_logits is not None and x.shape[0] <= self._decode_max_tokens:
            return self._decode_logits(x, self.weight)
        return F.linear(x.float(), self.weight)


class StackedExperts(nn.Module):
    """The routed experts' weights, stacked; loads per-expert checkpoint tensors into their slices.

    Implements the loader's checkpoint-mapping protocol (`checkpoint_shards`,
    `resolve_checkpoint_name`, `checkpoint_name`, `load_shard`). Shard ids are
    `"{expert}.gate"` / `"{expert}.up"` of `w13` and `"{expert}.down"` of `w2`.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        names: ExpertNames,
        dtype: torch.dtype,
        device: torch.device | str,
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert  # global id of local expert 0 (an EP rank holds a contiguous range)
        self.intermediate_size = intermediate_size
        self.names = names
        self.dtype = dtype  # of the weights when they are not fp8
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=weight_dtype(dtype), device=device),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=weight_dtype(dtype), device=device),
            requires_grad=False,
        )
        self._part_of = {names.gate: "gate", names.up: "up", names.down: "down"}
        self._name_of = {part: name for name, part in self._part_of.items()}
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)
        self.fp8_block: BlockSize | None = None
        self.checkpoint_block: BlockSize | None = None

    def use_fp8(
        self, block: BlockSize, *, checkpoint_block: BlockSize | None, reduce_amax: AmaxReduce | None = None
    ) -> None:
        """fp8 `w13`/`w2`: empty storage for a serialized checkpoint, or the loaded weights quantised (None;
        `reduce_amax` for `w2` when its input features are split over ranks, see `fp8_weights.AmaxReduce`)."""
        for attr in ("w13", "w2"):
            if checkpoint_block is None:
                quantize_in_place(self, attr, block, reduce_amax if attr == "w2" else None)
            else:
                make_fp8_storage(self, attr, block)
        self.fp8_block, self.checkpoint_block = block, checkpoint_block

    def checkpoint_shards(self, attr: str) -> tuple[str, ...]:
        parts = ("gate", "up") if attr.removesuffix(SCALE_SUFFIX) == "w13" else ("down",)
        return tuple(f"{e}.{part}" for e in range(self.num_experts) for part in parts)  # local ids

    def resolve_checkpoint_name(self, rest: str) -> tuple[str, str | None] | None:
        """(parameter, shard) for a checkpoint name relative to this module, None if it is not ours."""
        if rest in _STACKED_NAMES:
            return _STACKED_NAMES[rest], None
        expert, _, tail = rest.partition(".")
        leaf, _, attr = tail.partition(".")
        part = self._part_of.get(leaf)
        if not expert.isdigit() or part is None:
            return None
        if attr not in ("weight", "weight" + SCALE_SUFFIX):
            return None
        local = int(expert) - self.first_expert
        if not 0 <= local < self.num_experts:
            return None
        suffix = attr.removeprefix("weight")
        return ("w2" if part == "down" else "w13") + suffix, f"{local}.{part}"

    def checkpoint_name(self, attr: str, shard: str) -> str:
        expert, _, part = shard.partition(".")
        scale = SCALE_SUFFIX if attr.endswith(SCALE_SUFFIX) else ""
        return f"{int(expert) + self.first_expert}.{self._name_of[part]}.weight{scale}"

    def load_shard(self, attr: str, shard: str, tensor: torch.Tensor) -> None:
        expert_text, _, part = shard.partition(".")
        expert = int(expert_text)
        inter = self.intermediate_size
        if attr.endswith(SCALE_SUFFIX):
            self._load_scale(attr, expert, part, tensor)
            return
        if part == "down":
            target = self.w2.data[expert]
        else:
            target = self.w13.data[expert].narrow(0, 0 if part == "gate" else inter, inter)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {expert} {part}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)

    def _load_scale(self, attr: str, expert: int, part: str, tensor: torch.Tensor) -> None:
        scales = getattr(self, attr)
        if scales is None or self.fp8_block is None or self.checkpoint_block is None:
            raise ValueError(f"expert {expert} {part}: a weight_scale_inv for experts that are not fp8")
        inter, hidden = self.intermediate_size, self.w2.shape[1]
        offset = inter if part == "up" else 0
        size, k = (hidden, inter) if part == "down" else (inter, hidden)
        load_scale_part(scales.data[expert], tensor, offset=offset, size=size, in_features=k,
                        block=self.fp8_block, checkpoint_block=self.checkpoint_block,
                        what=f"expert {expert} {part}")


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (+ shared experts) for one decoder layer; see the module docstring."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        *,
        expert_names: ExpertNames = QWEN_EXPERT_NAMES,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(
            hidden_size,
            moe.num_experts,
            correction_bias=moe.has_correction_bias,
            dtype=dtype,
            device=device,
        )
        # On N ranks (`placement.rank_context`): this EP rank's experts, each over its MoE-TP slice of
        # the intermediate dimension, and its slice of the shared experts; the output is a partial sum.
        context = current_rank_context()
        first, count = (0, moe.num_experts) if context is None else context.local_experts(moe.num_experts)
        inter = moe.moe_intermediate_size if context is None else context.moe_intermediate(moe.moe_intermediate_size)
        shared = moe.num_shared_experts * moe.moe_intermediate_size
        self.local_experts = None if count == moe.num_experts else (first, count)
        self.experts = StackedExperts(
            count, hidden_size, inter, names=expert_names, dtype=dtype, device=device, first_expert=first
        )
        self.shared_experts = (
            GatedMLP(
                hidden_size,
                shared if context is None else context.shared_intermediate(shared),
                dtype=dtype,
                device=device,
            )
            if moe.num_shared_experts
            else None
        )
        platform = platform_of(device)
        # Router logits are fp32 whatever the model dtype (see `Router`), so routing is selected for fp32.
        self._route = select_kernel("moe", "route", platform=platform, dtype=torch.float32).impl
        # The fastest experts kernel depends on the step's token count: resolved on both sides of the
        # crossover here, picked per call by the host-side batch size (no sync, CUDA-graph safe).
        self._experts = select_experts_by_batch(platform=platform, dtype=dtype)
        self._experts_fp8: Callable[..., torch.Tensor] | None = None
        self._dtype = dtype

    def use_fp8(
        self, block: BlockSize, *, checkpoint_block: BlockSize | None, reduce_amax: AmaxReduce | None = None
    ) -> None:
        """Routed experts in fp8 (`StackedExperts.use_fp8`), run by `moe.experts_fp8`."""
        self.experts.use_fp8(block, checkpoint_block=checkpoint_block, reduce_amax=reduce_amax)
        platform = platform_of(self.experts.w13.device)
        self._experts_fp8 = select_kernel("moe", "experts_fp8", platform=platform, dtype=self._dtype).impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = self._route(
            self.gate(x),
            top_k=moe.top_k,
            scoring=moe.scoring,
            renormalize=moe.renormalize,
            num_groups=moe.num_groups,
            topk_groups=moe.topk_groups,
            group_scoring=moe.group_scoring,
            correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
        if self.local_experts is not None:  # expert parallel: other ranks' experts count zero here
            first, count = self.local_experts
            ids = ids - first
            elsewhere = (ids < 0) | (ids >= count)
            ids = ids.masked_fill(elsewhere, 0)
            weights = weights.masked_fill(elsewhere, 0.0)
        experts = self.experts
        if self._experts_fp8 is not None:
            out: torch.Tensor = self._experts_fp8(
                x, experts.w13, experts.w2, weights, ids,
                w13_scale=experts.w13_scale_inv, w2_scale=experts.w2_scale_inv, block_size=experts.fp8_block,
            )
        else:
            out = self._experts(x, experts.w13, experts.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        moe = self.moe
        return f"experts={moe.num_experts}, top_k={moe.top_k}, scoring={moe.scoring}"
