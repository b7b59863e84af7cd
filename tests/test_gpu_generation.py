"""Greedy bf16 generation on the GPU against `transformers`, and fast paths that must not change tokens.

Tolerance (bf16 is not bit-reproducible across two implementations): our
greedy tokens are replayed (teacher forcing) through HF in fp32 on the very
bf16-rounded weights, and through HF in bf16. Our reported log-probability of
each chosen token may differ from fp32's by at most twice what HF's own bf16
path differs, plus 0.02 nats. Greedy sequences themselves may part where two
tokens nearly tie; the first position where ours leaves HF's bf16 greedy
sequence is reported (printed and, with `TOKENSPEED_GPU_REPORT=path`,
appended as JSON), never hidden, together with how far below fp32's best
token each of our choices was.

CUDA graphs on/off and overlap on/off must give *identical* tokens: those
paths run the same kernels on the same shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_checkpoint, prompts
from tests.gpu_parity import (
    first_divergence,
    free_cuda,
    greedy_with_logprobs,
    hf_greedy,
    hf_references,
    report,
    teacher_forced_logprobs,
)
from tokenspeed import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NEW_TOKENS = 32
# Llama-shaped: head_dim 128, GQA 4:1, llama3 rope scaling, untied embeddings.
LLAMA_SMALL = dict(
    hidden_size=2048, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=8192, max_position_embeddings=8192, tie_word_embeddings=False,
    initializer_range=0.04,
)


@pytest.fixture(scope="module")
def llama_small(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama-small"), **LLAMA_SMALL)


def _engine(folder, **kw) -> LLM:
    args = dict(skip_tokenizer_init=True, dtype="bfloat16", device="cuda", num_kv_pages=2048,
                max_model_len=1024, max_num_seqs=16, show_progress=False)
    args.update(kw)
    return LLM(str(folder), **args)


def _generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


@pytest.mark.parametrize("which", ["tiny-llama", "llama-small"])
def test_greedy_bf16_matches_transformers(which, checkpoints, llama_small):
    folder = checkpoints["llama"] if which == "tiny-llama" else llama_small
    vocab = 384 if which == "tiny-llama" else LLAMA_SMALL["vocab_size"]
    batch = [[t % vocab for t in p] for p in prompts(4, seed=3, min_len=5, max_len=200)]
    llm = _engine(folder)
    ours, our_lps = greedy_with_logprobs(llm, batch, NEW_TOKENS)
    del llm
    free_cuda()

    hf32, hf16 = hf_references(folder)

    for prompt, tokens, lps in zip(batch, ours, our_lps):
        index = torch.tensor(tokens, device="cuda")[:, None]
        lp32 = teacher_forced_logprobs(hf32, prompt, tokens)
        ref32 = lp32.gather(1, index).squeeze(1)
        ref16 = teacher_forced_logprobs(hf16, prompt, tokens).gather(1, index).squeeze(1)
        our_err = (torch.tensor(lps, device="cuda") - ref32).abs().max().item()
        hf_err = (ref16 - ref32).abs().max().item()
        gap = (lp32.max(dim=1).values - ref32).max().item()
        free_run = hf_greedy(hf16, prompt, NEW_TOKENS)
        report({"test": "greedy_vs_transformers", "model": which, "prompt_len": len(prompt),
                 "first_divergence_vs_hf_bf16": first_divergence(tokens, free_run),
                 "max_logprob_err_vs_fp32": round(our_err, 5), "hf_bf16_max_logprob_err_vs_fp32": round(hf_err, 5),
                 "max_gap_below_fp32_argmax": round(gap, 5)})
        # Our bf16 path may err no more than HF's own bf16 path (x2, plus a small floor) on the same tokens.
        assert our_err <= 2 * hf_err + 0.02, f"logprob error {our_err:.4f} vs HF bf16's {hf_err:.4f}"
    del hf32, hf16
    free_cuda()


def test_cuda_graphs_and_overlap_give_identical_tokens(llama_small):
    batch = prompts(8, seed=5, min_len=10, max_len=300)
    batch = [[t % LLAMA_SMALL["vocab_size"] for t in p] for p in batch]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    graphs_on = None
    for eager in (True, False):
        for overlap in (False, True):
            llm = _engine(llama_small, enforce_eager=eager, disable_overlap=not overlap)
            if not eager:
                graphs_on = llm.core.executor.cuda_graphs_enabled
            results[(eager, overlap)] = (
                _generate(llm, batch, greedy), _generate(llm, batch, sampled), _generate(llm, batch[:5], greedy)
            )
            del llm
            free_cuda()
    report({"test": "graphs_overlap_identical", "cuda_graphs_enabled": graphs_on})
    reference = results[(True, False)]
    for key, value in results.items():
        for name, got, want in zip(("greedy-8", "sampled-8", "greedy-5"), value, reference):
            for i, (g, w) in enumerate(zip(got, want)):
                assert g == w, (
                    f"eager={key[0]} overlap={key[1]} {name} row {i}: first divergence at {first_divergence(g, w)}"
                )
    assert graphs_on, "the decode attention kernel should be capturable on CUDA"


def test_greedy_draw_kernels_give_identical_tokens(llama_small):
    """The one-launch Triton argmax (the default on CUDA) against torch's (`sampling.argmax=reference`)."""
    from tokenspeed.kernels.sampling.argmax_triton import argmax_triton
    from tokenspeed.kernels.sampling.reference import argmax_reference

    batch = [[t % LLAMA_SMALL["vocab_size"] for t in p] for p in prompts(8, seed=6, min_len=10, max_len=300)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for kernel, impl in (("triton", argmax_triton), ("reference", argmax_reference)):
        llm = _engine(llama_small, kernel_overrides=(f"sampling.argmax={kernel}",))
        assert llm.core.executor.runner.sampler._kernels_of(torch.device("cuda")).argmax is impl
        results[kernel] = _generate(llm, batch, greedy)
        del llm
        free_cuda()
    assert results["triton"] == results["reference"]


def test_staging_kernels_give_identical_tokens(llama_small):
    """A step's inputs by the one-launch staging kernel (the default on CUDA, writing into the graphs' buffers)
    against torch's ops (`staging.step_inputs=reference`), graphs and overlap on, greedy and seeded sampling."""
    from tokenspeed.kernels.staging.step_inputs import step_inputs_reference
    from tokenspeed.kernels.staging.step_inputs_triton import step_inputs_triton

    batch = [[t % LLAMA_SMALL["vocab_size"] for t in p] for p in prompts(8, seed=7, min_len=10, max_len=300)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=13, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for kernel, impl in (("triton", step_inputs_triton), ("reference", step_inputs_reference)):
        llm = _engine(llama_small, kernel_overrides=(f"staging.step_inputs={kernel}",))
        assert llm.core.executor.runner.staging.resolve is impl and llm.core.executor.cuda_graphs_enabled
        results[kernel] = (_generate(llm, batch, greedy), _generate(llm, batch[:3], sampled))
        del llm
        free_cuda()
    assert results["triton"] == results["reference"]


def test_preset_runs_at_full_shape_with_dummy_weights():
    llm = LLM("llama-3.1-8b", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              max_model_len=4096, num_kv_pages=1024, max_num_seqs=8, show_progress=False)
    assert llm.core.executor.model_config.hidden_size == 4096
    out = _generate(llm, [list(range(1000, 1100))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4
    del llm
    free_cuda()
