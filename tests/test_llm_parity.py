"""End to end against Hugging Face `transformers`: same random weights, fp32, CPU.

Greedy tokens must be identical for 32 new tokens on a batch of 8 prompts of
different lengths, and every step's log-probabilities must match HF's
log-softmaxed logits within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import load_hf, prompts
from tokenspeed import LLM, SamplingParams

NEW_TOKENS = 32
TOP_LOGPROBS = 5


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF generate, greedy, never stopping early; returns tokens and per-step log-softmax."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1)[0].float(), dim=-1)
    return tokens, logprobs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_and_logprobs_match_transformers(checkpoints, family):
    folder = checkpoints[family]
    hf = load_hf(folder)
    batch = prompts(8, seed=3, min_len=3, max_len=60)
    llm = LLM(str(folder), skip_tokenizer_init=True, page_size=16, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)

    for prompt, output in zip(batch, outputs):
        expected_tokens, expected_logprobs = hf_greedy(hf, prompt)
        got = output.outputs[0]
        assert got.token_ids == expected_tokens, f"{family}: first divergence at " + str(
            next(i for i, (a, b) in enumerate(zip(got.token_ids, expected_tokens)) if a != b)
        )
        for step, position in enumerate(got.logprobs):
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - expected_logprobs[step, token_id].item()) < 1e-4


def test_mqa_and_sliding_window_beyond_window(checkpoints):
    """Prompts longer than Mistral's 24-token window exercise the sliding mask through pages."""
    folder = checkpoints["mistral"]
    hf = load_hf(folder)
    batch = prompts(3, seed=9, min_len=50, max_len=80)
    llm = LLM(str(folder), skip_tokenizer_init=True, page_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt)[0]


def test_prompt_logprobs_match_transformers(checkpoints):
    folder = checkpoints["qwen3"]
    hf = load_hf(folder)
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    llm = LLM(str(folder), skip_tokenizer_init=True, max_num_batched_tokens=7)  # chunked: 5 chunks
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        token = prompt[position]
        assert abs(entry[token].logprob - reference[position - 1, token].item()) < 1e-4
        best = int(reference[position - 1].argmax())
        assert best in entry and entry[best].rank == 1
