"""The sampler on hand-made logits: each option does what vLLM documents."""

from __future__ import annotations

import math

import torch

from tokenspeed.executor.sampler import Sampler, SampleSpec, apply_penalties
from tokenspeed.kernels.sampling.reference import filter_probs_reference
from tokenspeed.scheduler.sampling_params import SamplingParams

V = 10


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return filter_probs_reference(probs, params.top_k, params.top_p, params.min_p)


def spec(params: SamplingParams, seed: int = 0, index: int = 0, prompt=(), output=()) -> SampleSpec:
    return SampleSpec(params, seed, index, list(prompt), list(output))


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    out = Sampler()(logits, [spec(SamplingParams(temperature=0.0))] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_same_key_same_token_different_keys_cover_distribution():
    logits = torch.zeros(1, V)  # uniform
    params = SamplingParams(temperature=1.0)
    draws = [Sampler()(logits, [spec(params, seed=5, index=i)]).token_ids[0] for i in range(400)]
    again = [Sampler()(logits, [spec(params, seed=5, index=i)]).token_ids[0] for i in range(400)]
    assert draws == again
    counts = [draws.count(t) for t in range(V)]
    assert min(counts) > 20  # every token drawn; expected 40 each


def test_sampling_frequencies_follow_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5)
    n = 3000
    draws = [Sampler()(logits, [spec(params, seed=1, index=i)]).token_ids[0] for i in range(n)]
    expected = torch.softmax(logits[0] / 0.5, -1).tolist()
    for token, p in enumerate(expected):
        assert abs(draws.count(token) / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_top_k_top_p_min_p_filter():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    assert filter_probs(probs, SamplingParams(top_k=2)).nonzero().flatten().tolist() == [0, 1]
    # top_p 0.65: 0.4 + 0.3 reaches it, so exactly two tokens stay.
    assert filter_probs(probs, SamplingParams(top_p=0.65)).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(probs, SamplingParams(top_p=0.7)).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(probs, SamplingParams(top_p=0.71)).nonzero().flatten().tolist() == [0, 1, 2]
    # min_p 0.5: keep tokens with p >= 0.5 * 0.4.
    assert filter_probs(probs, SamplingParams(min_p=0.5)).nonzero().flatten().tolist() == [0, 1, 2]
    logits = torch.log(probs)[None]
    for i in range(200):
        token = Sampler()(logits, [spec(SamplingParams(top_k=2, temperature=1.0), seed=i)]).token_ids[0]
        assert token in (0, 1)


def test_penalties_follow_vllm_rules():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [spec(params, prompt=[0], output=[1, 2, 2])])
    # token 0: prompt only -> repetition: 2/2 = 1
    # token 1: output once -> -2*2 = -4, then -0.5*1 - 0.25 = -4.75
    # token 2: output twice -> 1/2 = 0.5, then -0.5*2 - 0.25 = -0.75
    assert logits[0].tolist() == [1.0, -4.75, -0.75, 1.0, 0.5]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 0.0]])  # token 1 (eos) is by far the best
    params = SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(1,))
    assert Sampler()(logits, [spec(params, index=0)]).token_ids == [0]
    assert Sampler()(logits, [spec(params, index=2)]).token_ids == [1]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, eos_token_ids=(1,))
    assert Sampler()(logits, [spec(ignore, index=0)]).token_ids == [1]


def test_logprobs_are_raw_with_rank_and_top_k():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0)
    out = Sampler()(logits, [spec(params, prompt=[0])])
    entry = out.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [2]  # the penalty moved the choice ...
    assert entry.token_id == 2 and entry.rank == 2  # ... but logprobs are of the raw model output
    assert abs(entry.logprob - raw[2].item()) < 1e-6
    assert [t for t, _ in entry.top] == [0, 2]
