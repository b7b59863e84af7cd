"""Pre-packed fp32 linears for the CPU decode forward: oneDNN's blocked weights where they pay.

`F.linear` on the CPU runs MKL's `sgemm` on the `[out, in]` weight as stored. On the dev host's AMD
EPYC (AVX-512, one thread) that reaches 20-60 GFLOP/s at 1-16 rows, where oneDNN's JIT kernels on a
weight reordered once into their blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then
`torch.ops.mkldnn._linear_pointwise`: what inductor's CPU weight-prepack pass and vLLM's CPU backend
run) reach 55-105; but each oneDNN call costs ~11 us of fixed overhead against ~2 us for `F.linear`,
so small weights at few rows lose. Measured (`benchmarks/cpu_linear_gemm.py`, results in
`benchmarks/results/cpu/cpu_gemm_prepack.md`), oneDNN over `F.linear`:

- 1M-element weights (the embedded model's LM head, 256 -> 4096): 1.35x at 1 row, 1.7-2.7x at 2-8;
  1-2B-model shapes (2048 -> 2048, 2048 -> 16384): 1.04-1.36x at 1 row, 1.7-2.8x at 2-8 rows;
- 256 -> 1152 (embedded gate_up): 0.93x at 1 row, 1.7x at 2, 1.55x at 4, 1.28x at 16;
- 64K-150K-element weights (embedded qkv, o_proj, down): 0.4-0.9x below 8 rows, 0.86-1.09x at 8-16
  alone in a loop, 1.07-1.10x from 64 rows (prefill chunks). Inside the decode forward, where MKL's
  weight and packing buffers are not hot, packing them too from 8 rows took the 16-row step (forward
  + LM head) another 2-4% down, from 2-4 rows nothing (`benchmarks/cpu_gemm_prepack_forward.py`).
- One row (B=1 decode): the packed LM head alone took 73 us against 104, but the whole step (forward +
  LM head) got ~30 us slower with it (the next step's MKL GEMMs find their caches colder), so no
  weight runs packed at one row.

Up to 16 rows (decode steps) a native kernel goes before both where a C compiler works
(`kernels/cpu_small_gemm.py`: the weight packed once more as 16-column blocks, a tile of rows in
registers): on the embedded model's shapes 1.1-2.4x faster than the better of MKL and oneDNN at 1-16
rows alone, and inside the decode step (forward + LM head, one thread) 4 rows 2.01 / 1.89 -> 1.16 /
1.21 ms, one row 716 -> 526 us (`benchmarks/results/cpu/cpu_fused_ops.md`). Off with the rest
(`--disable-cpu-gemm-prepack`) or alone (`TOKENSPEED_CPU_SMALL_GEMM=0`). Above 16 rows:

Hence `rows_min`: the packed kernel runs from 2 rows for weights of 2^18 elements or more, from 8
rows below that; fewer rows keep `F.linear` on the original weight (the packed one is a copy, as
large as the weight: the eager layers keep theirs). oneDNN sums in another order than MKL, so
results differ in fp32 rounding (~1e-6 relative per GEMM), not bit for bit: the off switch
(`--disable-cpu-gemm-prepack`, `EngineConfig.disable_cpu_gemm_prepack`, or env
`TOKENSPEED_CPU_GEMM_PREPACK=0`) gives back `F.linear` everywhere. Where torch lacks the ops (no
oneDNN build) or they fail a check against `F.linear` at packing time, the weight stays unpacked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenspeed.kernels.cpu_small_gemm import MAX_ROWS as SMALL_MAX_ROWS
from tokenspeed.kernels.cpu_small_gemm import SmallGemm, small_gemm

logger = logging.getLogger("tokenspeed.executor")

ENV_SWITCH = "TOKENSPEED_CPU_GEMM_PREPACK"
# (weight elements at least, rows from which the packed kernel runs), largest first; smaller weights
# use it from `SMALL_WEIGHT_ROWS` rows (see the module docstring for the measurements).
ROWS_MIN_BY_SIZE: tuple[tuple[int, int], ...] = ((1 << 18, 2),)
SMALL_WEIGHT_ROWS = 8
# The packed weights are a second copy (the eager layers keep theirs): past this many bytes of weights the
# copy would cost more memory than a CPU server should spend on it, so larger models run unpacked.
PREPACK_MAX_BYTES = 1 << 30


def prepack_enabled() -> bool:
    """Whether to pre-pack where the config does not say: not unless `TOKENSPEED_CPU_GEMM_PREPACK=0`."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def rows_min(weight: torch.Tensor) -> int:
    """Fewest rows from which the packed kernel beats `F.linear` on a weight of this size."""
    elements = weight.numel()
    return next((rows for size, rows in ROWS_MIN_BY_SIZE if elements >= size), SMALL_WEIGHT_ROWS)


class CPULinear:
    """`x @ weight.T` for `[rows, in]` fp32 rows: the native small GEMM up to `cpu_small_gemm.MAX_ROWS`
    rows where there is one, oneDNN on the packed weight from `rows_min` rows, else `F.linear` on the
    original (the same call as the eager layers)."""

    __slots__ = ("weight", "packed", "rows_min", "_op", "small")

    def __init__(
        self, weight: torch.Tensor, packed: torch.Tensor | None = None, min_rows: int = 1,
        op: Callable[..., torch.Tensor] | None = None, small: SmallGemm | None = None,
    ) -> None:
        self.weight = weight
        self.packed = packed if op is not None else None
        self.rows_min = min_rows
        self._op = op
        self.small = small

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.shape[0] <= SMALL_MAX_ROWS:
            return self.small(x)
        if self.packed is not None and x.shape[0] >= self.rows_min:
            assert self._op is not None
            return self._op(x.contiguous(), self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def packed_bytes(self) -> int:
        copies = (self.packed is not None) + (self.small is not None)
        return copies * self.weight.numel() * self.weight.element_size()


def _packed_linear_op() -> Callable[..., torch.Tensor] | None:
    """oneDNN's linear on a packed weight, or None where this torch has no oneDNN."""
    try:
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return None
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def pack(weight: torch.Tensor, *, enabled: bool = True, small: bool = True) -> CPULinear:
    """A `CPULinear` of `weight` (`[out, in]`, fp32, CPU, frozen: the packed copies are not refreshed),
    packed when `enabled` and the oneDNN ops are there and agree with `F.linear` on a probe; with the
    native small GEMM for few rows too when `enabled` and `small` (`cpu_small_gemm.small_gemm`)."""
    op = _packed_linear_op() if enabled else None
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return CPULinear(weight)
    few = _small(weight) if enabled and small else None
    if op is None:
        return CPULinear(weight, small=few)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got, want = op(probe, packed, None, "none", [], ""), F.linear(probe, weight)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            raise RuntimeError("packed linear disagrees with F.linear")
    except (AttributeError, RuntimeError) as exc:
        logger.debug("CPU GEMM prepack off for a %s weight: %s", tuple(weight.shape), exc)
        return CPULinear(weight, small=few)
    return CPULinear(weight, packed, rows_min(weight), op, few)


def _small(weight: torch.Tensor) -> SmallGemm | None:
    """The native small GEMM of `weight`, checked against `F.linear` on a probe; None where unavailable."""
    try:
        few = small_gemm(weight)
        if few is None:
            return None
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, want = few(probe), F.linear(probe, weight)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            raise ValueError("the small GEMM disagrees with F.linear")
    except ValueError as exc:
        logger.debug("CPU small GEMM off for a %s weight: %s", tuple(weight.shape), exc)
        return None
    return few


def pack_lm_head(model: torch.nn.Module) -> CPULinear | None:
    """The LM head as a packed `CPULinear` where `compute_logits` is a plain fp32 `F.linear` (an `LMHead`
    with no decode GEMM kernel) and packing took; else None (`compute_logits` runs)."""
    from tokenspeed.layers.embedding import LMHead
    from tokenspeed.models.llama import DecoderForCausalLM

    head = getattr(model, "lm_head", None)
    if (type(head) is not LMHead or getattr(model, "_lm_head_gemm", None) is not None
            or getattr(type(model), "compute_logits", None) is not DecoderForCausalLM.compute_logits):
        return None
    linear = pack(head.weight)
    return linear if linear.packed is not None or linear.small is not None else None
