"""DeepSeek-V2/V3 (MLA + MoE) end to end against transformers, fp32 on the CPU.

Tiny random checkpoints (`tests/checkpoints.py`) cover: V3 with and without
q low-rank, noaux_tc routing with a non-zero correction bias over expert
groups, YaRN with mscale != mscale_all_dim (softmax scale and cos/sin both
change), V2 group-limited and plain greedy routing with V2's complex rope.
Layer 0 is dense and layer 1 MoE in every case.

The engine runs with the prefix cache hit (prompts share prefixes), chunked
prefill (a small token budget) and pages that split prompts, so the latent
cache is written and read back through the page table in every way a
serving step does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import DEEPSEEK_FAMILIES, load_hf, make_deepseek_checkpoint, prompts
from tokenspeed import LLM, SamplingParams

NEW_TOKENS = 32
TOLERANCE = 1e-4


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy argmax of HF's logits with its KV cache, EOS included (`generate` with
    `min_new_tokens` would mask EOS, which `ignore_eos` does not); tokens and per-step log-softmax."""
    tokens: list[int] = []
    steps = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW_TOKENS):
            logits = out.logits[0, -1].float()
            steps.append(torch.log_softmax(logits, dim=-1))
            tokens.append(int(logits.argmax()))
            out = model(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
    return tokens, torch.stack(steps)


def assert_matches_hf_greedy(hf: torch.nn.Module, prompt: list[int], got: Any, what: str) -> None:
    """One engine completion (`got`: its tokens and top logprobs) against `hf_greedy` on the same prompt:
    identical tokens, every logprob within TOLERANCE."""
    expected_tokens, expected_logprobs = hf_greedy(hf, prompt)
    mismatch = [i for i, (a, b) in enumerate(zip(got.token_ids, expected_tokens)) if a != b]
    assert not mismatch, f"{what}: first divergence at new token {mismatch[0]}"
    for step, position in enumerate(got.logprobs):
        for token_id, logprob in position.items():
            diff = abs(logprob.logprob - expected_logprobs[step, token_id].item())
            assert diff < TOLERANCE, f"{what}: step {step} token {token_id} off by {diff:.3g}"


def _shared_prefix_prompts() -> list[list[int]]:
    """8 prompts, pairs of which share 12- to 30-token prefixes (prefix-cache hits across pages)."""
    base = prompts(4, seed=11, min_len=12, max_len=30)
    tails = prompts(8, seed=12, min_len=3, max_len=17)
    return [base[i // 2] + tails[i] for i in range(8)]


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = request.param
    return family, make_deepseek_checkpoint(family, tmp_path_factory.mktemp(family))


def test_greedy_tokens_and_logprobs_match_transformers(checkpoint: tuple[str, Path]) -> None:
    family, folder = checkpoint
    hf = load_hf(folder)
    batch = _shared_prefix_prompts()
    llm = LLM(str(folder), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=24, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    first = llm.generate([{"prompt_token_ids": p} for p in batch[::2]], params)
    second = llm.generate([{"prompt_token_ids": p} for p in batch[1::2]], params)
    outputs = [o for pair in zip(first, second) for o in pair]
    assert sum(o.num_cached_tokens for o in second) > 0, "the second wave must hit the prefix cache"

    distinct = set()
    for prompt, output in zip(batch, outputs):
        assert_matches_hf_greedy(hf, prompt, output.outputs[0], family)
        distinct.update(output.outputs[0].token_ids)
    assert len(distinct) > NEW_TOKENS // 2, f"{family}: degenerate greedy output ({len(distinct)} tokens)"


def test_prompt_logits_at_every_position_match_transformers(checkpoint: tuple[str, Path]) -> None:
    """Prompt logprobs score every position; chunked at 7 tokens over 4-token pages."""
    family, folder = checkpoint
    hf = load_hf(folder)
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    llm = LLM(str(folder), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=7)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        token = prompt[position]
        got = out.prompt_logprobs[position][token].logprob
        diff = abs(got - reference[position - 1, token].item())
        assert diff < TOLERANCE, f"{family}: prompt position {position} off by {diff:.3g}"
