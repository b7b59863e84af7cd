"""Decode GEMV kernels (`gemm.decode`, `gemm.decode_silu_mul`) against their references on the CPU.

Runs under Triton's interpreter (set before triton is imported; otherwise the
file reruns itself in a fresh process; see `tests/triton_interpreter.py`), in
fp32 and fp16 at tiny shapes: both inner loops (one token: register
reduction; several: tensor-core dot), ragged N and K (masked tails), bias,
and the fused SiLU-and-mul epilogue. The layer wiring is checked too: a
`Linear`, `GatedMLP` and LM head with the fast path switched on give what
they give with it off, and the registry keeps the fast path off on the CPU
and under a `=reference` override.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.gemm.gemv_triton import (
    GemvConfig,
    choose_config,
    gemv_silu_mul_triton,
    gemv_triton,
)
from tokenspeed.kernels.gemm.reference import gemv_reference, gemv_silu_mul_reference
from tokenspeed.kernels.registry import set_kernel_override
from tokenspeed.layers.linear import Linear, select_decode_gemm
from tokenspeed.layers.mlp import GatedMLP

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
CONFIGS = [None, GemvConfig(1, 8, 32, 4, 1), GemvConfig(1, 4, 16, 4, 2), GemvConfig(16, 16, 32, 4, 2)]


test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, slow=True)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 24, 64), (3, 19, 40), (1, 5, 100), (8, 33, 48)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else f"{c.block_m}x{c.block_n}")
def test_gemv_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, config: GemvConfig | None) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    for bias in (None, b):
        want = gemv_reference(x.double(), w.double(), None if bias is None else bias.double())
        got = gemv_triton(x, w, bias, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < TOL[dtype]
    logits = gemv_triton(x, w, out_dtype=torch.float32, config=config)
    assert logits.dtype == torch.float32
    # fp32 logits are the activation-dtype result widened, exactly as `F.linear(...).float()`.
    assert torch.equal(logits, logits.to(dtype).float())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,d,k", [(1, 16, 64), (2, 13, 40), (5, 8, 96)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else f"{c.block_m}x{c.block_n}")
def test_gemv_silu_mul_matches_reference(
    dtype: torch.dtype, m: int, d: int, k: int, config: GemvConfig | None
) -> None:
    gen = torch.Generator().manual_seed(m * 100 + d + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * d, k, generator=gen) * 0.3).to(dtype)
    b = torch.randn(2 * d, generator=gen).to(dtype)
    for bias in (None, b):
        want = gemv_silu_mul_reference(x.double(), w.double(), None if bias is None else bias.double())
        got = gemv_silu_mul_triton(x, w, bias, config=config)
        assert got.shape == (m, d)
        assert _rel_err(got, want) < 2 * TOL[dtype]


def test_choose_config_uses_the_dot_path_only_for_several_tokens() -> None:
    assert not choose_config(1, 4096, 4096).use_dot
    assert choose_config(4, 4096, 4096).use_dot
    assert choose_config(8, 14336, 4096, silu_mul=True).block_m == 16


def test_registry_keeps_the_fast_path_off_on_cpu_and_under_override() -> None:
    assert select_decode_gemm("decode", device="cpu", dtype=torch.float32) == (None, -1)
    assert Linear(8, 4)._decode_max_tokens == -1
    if torch.cuda.is_available():
        assert select_decode_gemm("decode", device="cuda", dtype=torch.bfloat16)[1] >= 1
        set_kernel_override("gemm", "decode", "reference")
        try:
            assert select_decode_gemm("decode", device="cuda", dtype=torch.bfloat16) == (None, -1)
        finally:
            set_kernel_override("gemm", "decode", None)


@interpreted
def test_layers_with_the_fast_path_on_match_it_off() -> None:
    torch.manual_seed(0)
    linear = Linear(40, 24, bias=True)
    mlp = GatedMLP(40, 12, bias=True)
    for module in (linear, mlp.gate_up_proj, mlp.down_proj):
        for p in module.parameters():
            p.data.normal_(0, 0.3)
    x = torch.randn(3, 40)
    want_linear, want_mlp = linear(x), mlp(x)
    for module in (linear, mlp.down_proj):
        module._decode_gemm, module._decode_max_tokens = gemv_triton, 8
    mlp._fused_gate_up, mlp._fused_max_tokens = gemv_silu_mul_triton, 8
    assert _rel_err(linear(x), want_linear) < 1e-5
    assert _rel_err(mlp(x), want_mlp) < 1e-5
    big = torch.randn(9, 40)  # above the decode range: the ordinary path, bit for bit
    linear._decode_max_tokens = 8
    assert torch.equal(linear(big), torch.nn.functional.linear(big, linear.weight, linear.bias))


def _llm_tokens(folder: object, batch: list[list[int]], fused: bool) -> list[list[int]]:
    from tokenspeed import LLM, SamplingParams

    llm = LLM(str(folder), skip_tokenizer_init=True, page_size=4, seed=0)
    layer = llm.core.executor.model.model.layers[0]
    assert (layer._fused_decode_max_tokens > 0) == fused
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)  # one-row steps
    return [o.outputs[0].token_ids for o in outs]


@interpreted
def test_fused_decode_layers_give_the_tokens_of_the_plain_path(checkpoints: dict[str, object]) -> None:
    """The decoder with every decode GEMM fused (norm prologues, residual and SiLU epilogues) vs without.

    The Triton kernels are registered for the CPU for this test only, so the
    interpreter runs them inside a real fp32 engine; greedy tokens must match.
    """
    from tokenspeed.kernels.gemm import DECODE_MAX_TOKENS
    from tokenspeed.kernels.registry import Band, register_kernel, unregister_kernel

    batch = [[5, 17, 99, 3, 250, 8], [41, 2, 77], [300, 12, 6, 6, 1]]
    plain = _llm_tokens(checkpoints["llama"], batch, fused=False)
    for mode, impl in (("decode", gemv_triton), ("decode_silu_mul", gemv_silu_mul_triton)):
        register_kernel("gemm", mode, name="triton-cpu-test", band=Band.PORTABLE, platforms=("cpu",),
                        workload={"num_tokens": (1, DECODE_MAX_TOKENS)}, impl=impl)
    try:
        assert select_decode_gemm("decode_silu_mul", device="cpu", dtype=torch.float32)[1] == DECODE_MAX_TOKENS
        fused = _llm_tokens(checkpoints["llama"], batch, fused=True)
    finally:
        for mode in ("decode", "decode_silu_mul"):
            unregister_kernel("gemm", mode, "triton-cpu-test")
    assert fused == plain
