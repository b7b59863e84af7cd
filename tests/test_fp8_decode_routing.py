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
from tokenspeed.kernels.gemm import FP8_FUSED_DECODE_MAX_TOKENS, FP8_GEMV_MAX_TOKENS
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


@interpreted
@pytest.mark.parametrize("block", [(128, 128), PER_CHANNEL_BLOCK])
def test_fp8_layers_route_the_decode_forms_to_the_fused_fp8_gemv(
    monkeypatch: pytest.MonkeyPatch, block: tuple[int, int]
) -> None:
    """Wiring: with the FP8 GEMV as the small-batch kernel (as on a GPU), an fp8 MLP's decode form is two
    fused kernels whose result equals the plain path (norm, gate/up, SiLU-and-mul, down, residual add)."""
    from tokenspeed.layers import mlp as mlp_module
    from tokenspeed.layers.mlp import GatedMLP
    from tokenspeed.layers.norm import RMSNorm
    from tokenspeed.models.fp8_model import _route_decode_paths

    mlp = _fp8_mlp_with_gpu_kernels(monkeypatch, block)
    assert mlp.decode_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS
    assert mlp._fused_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS  # 2-16 rows: gate/up, then the activation kernel
    gen = torch.Generator().manual_seed(6)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(256, generator=gen))
    x, residual = torch.randn(1, 256, generator=gen), torch.randn(1, 256, generator=gen)
    fused = mlp.forward_decode(x, norm=norm, residual=residual)
    plain = residual + mlp.down_proj(mlp._act(mlp.gate_up_proj(norm(x))))  # the reference FP8 kernels
    assert _rel_err(fused, plain) < 1e-5
    monkeypatch.setattr(mlp_module, "select_decode_gemm", lambda mode, **_: (None, -1))  # the off switch
    off = GatedMLP(256, 256, dtype=torch.float32)
    off.gate_up_proj.weight.data.zero_()
    off.gate_up_proj.use_fp8(block, checkpoint_block=None)
    _route_decode_paths(off)
    assert off.decode_max_tokens == -1


@interpreted
@pytest.mark.parametrize("block", [(128, 128), PER_CHANNEL_BLOCK])
def test_fp8_gate_up_takes_the_skinny_silu_mul_form_at_two_to_sixteen_rows_when_switched_on(
    monkeypatch: pytest.MonkeyPatch, block: tuple[int, int]
) -> None:
    """`TOKENSPEED_FP8_SKINNY_SILU=1`: a gated MLP's 2-16 rows run gate/up and the activation as one skinny
    GEMM (the result equals the plain path's); the decoder layer's fused bound stays at one row (no norm or
    residual form at 2-16), and `TOKENSPEED_FP8_SKINNY=0` (no skinny GEMM) keeps the activation kernel."""
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY_SILU", "1")
    mlp = _fp8_mlp_with_gpu_kernels(monkeypatch, block)
    assert mlp._fused_max_tokens == FP8_GEMV_MAX_TOKENS and mlp.decode_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(7))
    plain = mlp.down_proj(mlp._act(mlp.gate_up_proj(x)))  # the reference FP8 kernels
    assert _rel_err(mlp(x), plain) < 1e-5
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    assert _fp8_mlp_with_gpu_kernels(monkeypatch, block)._fused_max_tokens == FP8_FUSED_DECODE_MAX_TOKENS
