"""Qwen3-MoE and Mixtral end to end against Hugging Face `transformers` (tiny random checkpoints, fp32, CPU).

The engine runs 8 prompts that share prefixes, with a small per-step token
budget (chunked prefill) after a warm-up request, so the batch exercises
prefix-cache hits and multi-chunk prompts through the MoE layers. HF then
runs one full forward over each prompt + our 32 generated tokens:

- every generated token must be HF's argmax at its position, which by
  induction is exactly HF's greedy continuation;
- every log-probability the engine returned (top-5 per step, and the prompt
  log-probabilities of a chunked request) must match HF's within 1e-4.

Routing must actually vary for this to mean anything, so the fixture also
checks that the workload sends tokens to every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import load_hf, make_checkpoint, prompts
from tokenspeed import LLM, SamplingParams

NEW_TOKENS = 32
TOP_LOGPROBS = 5
TOLERANCE = 1e-4
SHARED = prompts(1, seed=21, min_len=36, max_len=36)[0]

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe-norm-topk": ("qwen3_moe", {}),
    "qwen3-moe-top3-unnormalised": ("qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=3)),
    "mixtral": ("mixtral", {}),
}


def workload() -> list[list[int]]:
    """8 prompts: five extend a shared 36-token prefix (cache hits once it is published), three do not."""
    own = prompts(8, seed=4, min_len=3, max_len=30)
    return [SHARED + p for p in own[:5]] + own[5:]


@dataclass
class Variant:
    folder: Path
    hf: Any


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Variant:
    family, overrides = VARIANTS[request.param]
    folder = make_checkpoint(family, tmp_path_factory.mktemp(request.param), seed=3, **overrides)
    return Variant(folder, load_hf(folder))


def _hf_logprobs(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_routing_reaches_every_expert(variant: Variant) -> None:
    """A checkpoint whose router always picks the same experts would make the parity tests vacuous."""
    top_k = variant.hf.config.num_experts_per_tok
    chosen: dict[int, set[int]] = {}
    for prompt in workload():
        with torch.no_grad():
            out = variant.hf(torch.tensor([prompt]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            chosen.setdefault(layer, set()).update(
                logits.float().topk(top_k, dim=-1).indices.flatten().tolist()
            )
    num_experts = out.router_logits[0].shape[-1]
    assert chosen and all(len(experts) == num_experts for experts in chosen.values()), chosen


def test_greedy_tokens_and_logprobs_match_transformers(variant: Variant) -> None:
    llm = LLM(str(variant.folder), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    llm.generate({"prompt_token_ids": SHARED + [5]}, params)  # publishes the shared prefix's pages
    batch = workload()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    assert sum(o.num_cached_tokens for o in outputs) >= 5 * 32, "the shared prefix should hit the cache"

    for prompt, output in zip(batch, outputs):
        got = output.outputs[0]
        assert len(got.token_ids) == NEW_TOKENS
        reference = _hf_logprobs(variant.hf, prompt + got.token_ids)[len(prompt) - 1 : -1]
        expected = reference.argmax(dim=-1).tolist()
        assert got.token_ids == expected, "first divergence at step " + str(
            next(i for i, (a, b) in enumerate(zip(got.token_ids, expected)) if a != b)
        )
        for step, position in enumerate(got.logprobs):
            assert len(position) >= TOP_LOGPROBS
            for token_id, logprob in position.items():
                diff = abs(logprob.logprob - reference[step, token_id].item())
                assert diff < TOLERANCE, f"step {step} token {token_id}: logprob off by {diff:.3g}"


def test_chunked_prompt_logprobs_match_transformers(variant: Variant) -> None:
    """Every prompt position's log-probabilities, computed in 7-token chunks, against one HF forward."""
    llm = LLM(str(variant.folder), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=7)
    batch = workload()[:2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for prompt, output in zip(batch, outputs):
        reference = _hf_logprobs(variant.hf, prompt)
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entry = output.prompt_logprobs[position]
            assert entry is not None and prompt[position] in entry
            for token_id, logprob in entry.items():
                diff = abs(logprob.logprob - reference[position - 1, token_id].item())
                assert diff < TOLERANCE, f"position {position} token {token_id}: off by {diff:.3g}"
