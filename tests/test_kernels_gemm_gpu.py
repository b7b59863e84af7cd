"""Decode GEMV kernels on a CUDA GPU at Llama-3.1-8B's shapes, and the engine with them on vs off.

Kernel checks are bf16 against an fp32 product of the same bf16 operands, for
1, 4 and 8 tokens, including capture and replay in a CUDA graph (how decode
runs them). The engine check runs a small Llama checkpoint in fp32, where the
GEMV and cuBLAS differ only by fp32 rounding, and requires identical greedy
tokens with `gemm.decode` / `gemm.decode_silu_mul` forced to the reference
(the off switch) and left to the registry, and identical bf16 tokens with
programmatic dependent launch on and off (`TOKENSPEED_PDL`).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

pytest.importorskip("triton")

from tests.checkpoints import make_checkpoint, prompts  # noqa: E402
from tokenspeed import LLM, SamplingParams  # noqa: E402
from tokenspeed.kernels.gemm.gemv_triton import gemv_silu_mul_triton, gemv_triton  # noqa: E402
from tokenspeed.kernels.gemm.reference import gemv_reference, gemv_silu_mul_reference  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096)]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_bf16_at_serving_shapes(m: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    want = gemv_reference(x.float(), w.float())
    assert _rel_err(gemv_triton(x, w), want) < 8e-3
    logits = gemv_triton(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and _rel_err(logits, want) < 8e-3


@pytest.mark.parametrize("m", [1, 4, 8])
def test_gemv_silu_mul_bf16_at_serving_shape(m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * 14336, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    want = gemv_silu_mul_reference(x.float(), w.float())
    assert _rel_err(gemv_silu_mul_triton(x, w), want) < 1e-2


def test_gemv_replays_in_a_cuda_graph() -> None:
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    gemv_triton(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_triton(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, gemv_reference(x.float(), w.float())) < 8e-3


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_dependent_gemv_chain_in_a_graph_reads_each_previous_result(pdl: str, monkeypatch) -> None:
    """Eight GEMVs, each reading the one before (x and residual), replayed from a graph.

    With programmatic dependent launch a kernel starts before its predecessor
    ends; a read of x or the residual before `gdc_wait` would see stale data
    and this chain would drift from the step-by-step reference.
    """
    monkeypatch.setenv("TOKENSPEED_PDL", pdl)
    gen = torch.Generator(device="cuda").manual_seed(5)
    weights = [(torch.randn(4096, 4096, device="cuda", generator=gen) * 0.015).bfloat16() for _ in range(8)]
    norm = torch.rand(4096, device="cuda", generator=gen).bfloat16() + 0.5
    x = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()

    def chain(h: torch.Tensor, fn) -> torch.Tensor:
        for i, w in enumerate(weights):
            h = fn(h, w, norm_weight=norm if i % 2 else None, eps=1e-5, residual=h)
        return h

    chain(x, gemv_triton)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, gemv_triton)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, chain(x.float(), lambda h, w, **kw: gemv_reference(
            h, w.float(), **{**kw, "norm_weight": None if kw["norm_weight"] is None else norm.float()}))) < 5e-2


def test_engine_tokens_identical_with_gemv_on_and_off(tmp_path, monkeypatch) -> None:
    folder = make_checkpoint(
        "llama", tmp_path, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, initializer_range=0.05,
    )
    batch = [[t % 4096 for t in p] for p in prompts(6, seed=9, min_len=5, max_len=120)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for switch in ("", "reference"):
        monkeypatch.setenv("TOKENSPEED_KERNEL_GEMM_DECODE", switch)
        monkeypatch.setenv("TOKENSPEED_KERNEL_GEMM_DECODE_SILU_MUL", switch)
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda", num_kv_pages=512,
                  max_model_len=512, max_num_seqs=8, show_progress=False)
        mlp = llm.core.executor.model.model.layers[0].mlp
        assert (mlp._fused_max_tokens > 0) == (switch == "")
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": batch[0]}], greedy, use_tqdm=False)  # bs1 steps
        tokens[switch] = [o.outputs[0].token_ids for o in outs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[""] == tokens["reference"]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_tokens_identical_with_pdl_on_and_off(quantization, tmp_path, monkeypatch) -> None:
    """bf16 and FP8 weights with CUDA graphs, one row and four (where the norms and SiLU-and-mul run as their own
    kernels): PDL changes only when kernels are scheduled, so tokens must be identical."""
    folder = make_checkpoint(
        "llama", tmp_path, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, initializer_range=0.05,
    )
    batch = [[t % 4096 for t in p] for p in prompts(4, seed=4, min_len=60, max_len=90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    monkeypatch.setenv("TOKENSPEED_AUTOTUNE", "0")  # launch shapes timed per run could differ, and their sums' order
    tokens = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("TOKENSPEED_PDL", pdl)
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cuda", num_kv_pages=512,
                  max_model_len=512, max_num_seqs=8, show_progress=False, quantization=quantization)
        assert llm.core.executor.cuda_graphs_enabled
        outs = llm.generate([{"prompt_token_ids": batch[0]}], greedy, use_tqdm=False)  # bs1 steps
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        tokens[pdl] = [o.outputs[0].token_ids for o in outs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["1"] == tokens["0"]
