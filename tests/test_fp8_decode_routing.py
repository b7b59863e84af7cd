"""An FP8 gated MLP's decode paths, wired as on a GPU (the FP8 GEMV as the small-batch kernel) with the Triton
kernels under the interpreter: which rows take which fused form, and that each gives the plain path's result."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_kernels_fp8_gemm import PER_CHANNEL_BLOCK, _rel_err
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.gemm import FP8_FUSED_DECODE_MAX_TOKENS
from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


def _fp8_mlp_with_gpu_kernels(monkeypatch: pytest.MonkeyPatch, block: tuple[int, int], seed: int = 5) -> Any:
    """A 256-wide fp8 GatedMLP wired as on a GPU (the FP8 GEMV as the small-batch kernel, a selected bf16
    decode kernel), its decode paths routed; the Triton kernels run under the interpreter."""
    from tokenspeed.kernels.gemm.fp8_dispatch import Fp8GemmByBatch
    from tokenspeed.layers import linear as linear_module
    from tokenspeed.layers import mlp as mlp_module
    from tokenspeed.layers.mlp import GatedMLP
    from tokenspeed.models.fp8_model import _route_decode_paths

    def decode_kernel(mode: str, **_: object) -> tuple[object, int]:
        return (lambda *a, **k: None), FP8_FUSED_DECODE_MAX_TOKENS  # a selected (non-reference) bf16 decode kernel

    monkeypatch.setattr(linear_module, "select_decode_gemm", decode_kernel)
    monkeypatch.setattr(mlp_module, "select_decode_gemm", decode_kernel)
    monkeypatch.setattr(Fp8GemmByBatch, "fused_decode", property(lambda self: fp8_gemv_triton))
    gen = torch.Generator().manual_seed(seed)
    mlp = GatedMLP(256, 256, dtype=torch.float32)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.05)
        linear.use_fp8(block, checkpoint_block=None)
    _route_decode_paths(mlp)
    return mlp


def _decode_form_error(mlp: Any, rows: int) -> float:
    """Relative difference of the MLP's decode form (norm, gate/up, SiLU-and-mul, down, residual add in its
    fused kernels) from the plain path on the reference FP8 kernels, for `rows` random rows."""
    from tokenspeed.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(256, generator=gen))
    x, residual = torch.randn(rows, 256, generator=gen), torch.randn(rows, 256, generator=gen)
    fused = mlp.forward_decode(x, norm=norm, residual=residual)
    return _rel_err(fused, residual + mlp.down_proj(mlp._act(mlp.gate_up_proj(norm(x)))))


@interpreted
@pytest.mark.parametrize("block", [(128, 128), PER_CHANNEL_BLOCK])
def test_fp8_layers_route_the_decode_forms_to_the_fused_fp8_gemv(
    monkeypatch: pytest.MonkeyPatch, block: tuple[int, int]
) -> None:
    """Wiring: with the FP8 GEMV as the small-batch kernel (as on a GPU), an fp8 MLP's decode form is two
    fused kernels whose result equals the plain path (norm, gate/up, SiLU-and-mul, down, residual add)."""
    from tokenspeed.layers import mlp as mlp_module
    from tokenspeed.layers.mlp import GatedMLP
    from tokenspeed.models.fp8_model import _route_decode_paths

    mlp = _fp8_mlp_with_gpu_kernels(monkeypatch, block)
    assert mlp.decode_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS
    assert mlp._fused_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS  # 2-16 rows: the plain path
    assert _decode_form_error(mlp, rows=1) < 1e-5
    monkeypatch.setattr(mlp_module, "select_decode_gemm", lambda mode, **_: (None, -1))  # the off switch
    off = GatedMLP(256, 256, dtype=torch.float32)
    off.gate_up_proj.weight.data.zero_()
    off.gate_up_proj.use_fp8(block, checkpoint_block=None)
    _route_decode_paths(off)
    assert off.decode_max_tokens == -1
