"""The verification math: greedy acceptance, the point-mass form, rejection sampling.

The statistical tests generate sequences from a tiny bigram "model" (vocab 4,
fixed random logits) with and without speculation, thousands of rows at once,
and compare the joint distribution of the first three emitted tokens with the
exact one by a chi-square test (fixed seeds: deterministic). Deliberately
wrong verifiers (resampling from the target instead of the residual, ignoring
the draft probabilities) are run through the same test and must fail it, so
the test can tell a right implementation from a wrong one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from tokenspeed.kernels.sampling.reference import filter_probs_reference, sample_reference
from tokenspeed.spec.verify import (
    DRAFT_STREAM,
    RESIDUAL_STREAM,
    Verified,
    accept_drafts,
    filtered_probs,
    keyed_categorical,
    keyed_uniform,
    rejection_sample,
    verify_greedy,
    verify_point_mass,
)

VOCAB = 4
LENGTH = 3  # tokens per sequence compared
START = 0


def test_accept_drafts_takes_the_longest_matching_prefix_then_the_target_token() -> None:
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7], [5, 9, 0]])
    verified = accept_drafts(target, drafts, torch.tensor([3, 3, 3, 1]))
    assert verified.rows() == [[5, 6, 7, 8], [5, 6], [5], [5, 9]]  # the last row drafted only one token
    assert verified.num_emitted.tolist() == [4, 2, 1, 2]
    assert verified.token_ids[1].tolist() == [5, 6, -1, -1]


def _bigram(seed: int, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64).float() * scale


def test_verify_greedy_is_greedy_decoding() -> None:
    table = _bigram(1)
    drafts = torch.tensor([[1, 2, 3], [2, 2, 2], [0, 0, 0]])
    last = torch.tensor([3, 1, 2])
    contexts = torch.cat([last[:, None], drafts], dim=1)  # position i sees the drafts before it
    verified = verify_greedy(table[contexts], drafts, torch.tensor([3, 2, 3]))
    for row, emitted in enumerate(verified.rows()):
        token, expected = int(last[row]), []
        for _ in range(len(emitted)):
            token = int(torch.argmax(table[token]))
            expected.append(token)
        assert emitted == expected
        accepted = len(emitted) - 1
        assert drafts[row, :accepted].tolist() == emitted[:accepted]


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [
    (0, 1.0, 0.0, 1.0), (3, 1.0, 0.0, 0.7), (0, 0.6, 0.0, 1.3), (0, 1.0, 0.2, 1.0), (5, 0.8, 0.05, 0.9),
    (0, 1.0, 0.0, 0.0),
])
def test_filtered_probs_are_the_samplers_distribution(top_k: int, top_p: float, min_p: float,
                                                       temperature: float) -> None:
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3)) * 2
    rows = logits.shape[0]
    probs = filtered_probs(logits, torch.full((rows,), temperature), torch.full((rows,), top_k),
                           torch.full((rows,), top_p), torch.full((rows,), min_p))
    for row in range(rows):
        if temperature == 0.0:
            expected = torch.nn.functional.one_hot(torch.argmax(logits[row]), 11).float()
        else:
            expected = filter_probs_reference(torch.softmax(logits[row] / temperature, dim=-1), top_k, top_p, min_p)
            expected = expected / expected.sum()
        torch.testing.assert_close(probs[row], expected)


def test_keyed_draws_depend_on_the_key_only() -> None:
    seeds, indices = torch.tensor([1, 2, 1]), torch.tensor([[0, 1], [0, 1], [0, 1]])
    u = keyed_uniform(seeds, indices, 7)
    assert ((u > 0) & (u < 1)).all() and u[0].tolist() == u[2].tolist() and u[0].tolist() != u[1].tolist()
    assert keyed_uniform(seeds[:1], indices[:1], 8).tolist() != u[:1].tolist()  # streams differ
    weights = torch.tensor([[[0.0, 1.0, 0.0, 1.0]] * 2] * 3, dtype=torch.float64)
    drawn = keyed_categorical(weights, seeds, indices, 7)
    assert set(drawn.flatten().tolist()) <= {1, 3} and drawn[0].tolist() == drawn[2].tolist()


# ---- statistical tests ---------------------------------------------------------------------------

TARGET = _bigram(11)
DRAFTER = _bigram(12, scale=1.0)  # a different, flatter model: its drafts are often rejected
Params = tuple[float, int, float, float]  # temperature, top_k, top_p, min_p
PARAMS: list[Params] = [(1.0, 0, 1.0, 0.0), (0.8, 3, 0.9, 0.0), (1.2, 0, 0.75, 0.1)]


def _probs(table: torch.Tensor, params: Params) -> torch.Tensor:
    temperature, top_k, top_p, min_p = params
    n = table.shape[0]
    return filtered_probs(table, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                          torch.full((n,), min_p)).to(torch.float64)


def _exact_joint(params: Params) -> torch.Tensor:
    probs = _probs(TARGET, params)
    joint = torch.zeros([VOCAB] * LENGTH, dtype=torch.float64)
    for tokens in itertools.product(range(VOCAB), repeat=LENGTH):
        p, last = 1.0, START
        for token in tokens:
            p *= float(probs[last, token])
            last = token
        joint[tokens] = p
    return joint


# (contexts [rows, k+1] token ids whose next token each position scores, drafts, num_drafts, seeds, count,
#  draft probabilities or None) -> what is emitted
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                    Verified]


def _generate(rows: int, k: int, params: Params, verifier: Verifier, model_drafts: bool) -> torch.Tensor:
    """The first LENGTH tokens of `rows` sequences, each step drafting k tokens then verifying them."""
    drafter = _probs(DRAFTER, params)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 1
    out = torch.full((rows, LENGTH + k + 1), -1, dtype=torch.int64)
    count = torch.zeros(rows, dtype=torch.int64)
    last = torch.full((rows,), START, dtype=torch.int64)
    while bool((count < LENGTH).any()):
        drafts = torch.zeros(rows, k, dtype=torch.int64)
        draft_probs = torch.zeros(rows, k, VOCAB, dtype=torch.float64)
        context = last
        for i in range(k):
            q = drafter[context]
            if model_drafts:  # sampled from the draft model with its own key stream
                token = keyed_categorical(q[:, None], seeds, (count + i)[:, None], DRAFT_STREAM)[:, 0]
            else:  # a deterministic drafter: its most likely token
                token = torch.argmax(q, dim=-1)
            drafts[:, i], draft_probs[:, i] = token, q
            context = token
        contexts = torch.cat([last[:, None], drafts], dim=1)
        num_drafts = torch.full((rows,), k, dtype=torch.int64)
        verified = verifier(contexts, drafts, num_drafts, seeds, count, draft_probs if model_drafts else None)
        for j in range(k + 1):
            emit = j < verified.num_emitted
            out[emit, torch.clamp(count + j, max=out.shape[1] - 1)[emit]] = verified.token_ids[emit, j]
        last = verified.token_ids.gather(1, (verified.num_emitted - 1)[:, None])[:, 0]
        count += verified.num_emitted
    return out[:, :LENGTH]


def _chi_square(samples: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """(statistic, the 1e-6 critical value for its degrees of freedom); a sample in a cell of probability 0 fails."""
    index = (samples * torch.tensor([VOCAB**2, VOCAB, 1])).sum(dim=1)
    observed = torch.bincount(index, minlength=VOCAB**LENGTH).to(torch.float64)
    expected = joint.flatten() * samples.shape[0]
    assert not bool(((expected == 0) & (observed > 0)).any()), "a token the target never emits was emitted"
    live = expected > 0
    statistic = float((((observed - expected) ** 2)[live] / expected[live]).sum())
    df = int(live.sum()) - 1
    z = 4.753  # one-sided normal quantile of 1e-6; Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def _rejection(params: Params) -> Verifier:
    target = _probs(TARGET, params)

    def verify(contexts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, seeds: torch.Tensor,
               count: torch.Tensor, draft_probs: torch.Tensor | None) -> Verified:
        return rejection_sample(target[contexts], drafts, num_drafts, seeds, count, draft_probs)

    return verify


def _point_mass(params: Params) -> Verifier:
    temperature, top_k, top_p, min_p = params

    def verify(contexts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, seeds: torch.Tensor,
               count: torch.Tensor, draft_probs: torch.Tensor | None) -> Verified:
        full = torch.ones(drafts.shape[0])
        return verify_point_mass(TARGET[contexts], drafts, num_drafts, full * temperature, (full * top_k).long(),
                                 full * top_p, full * min_p, seeds, count)

    return verify


def _plain(rows: int, params: Params) -> torch.Tensor:
    """Non-speculative decoding with the reference sampler, keyed by (seed, index)."""
    temperature, top_k, top_p, min_p = params
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 1
    last = torch.full((rows,), START, dtype=torch.int64)
    out = []
    full = torch.ones(rows)
    for index in range(LENGTH):
        token = sample_reference(TARGET[last], full * temperature, (full * top_k).long(), full * top_p,
                                 full * min_p, seeds, torch.full((rows,), index))
        out.append(token)
        last = token
    return torch.stack(out, dim=1)


ROWS = 20000


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("model_drafts", [True, False])
def test_rejection_sampling_emits_the_target_distribution(params: Params, model_drafts: bool) -> None:
    samples = _generate(ROWS, 2, params, _rejection(params), model_drafts)
    statistic, critical = _chi_square(samples, _exact_joint(params))
    assert statistic < critical


def test_a_wrong_verifier_fails_the_same_test() -> None:
    """Resampling from the target instead of the residual, or verifying against the wrong q, is caught.

    (Treating sampled drafts as point masses, accept with p(d) and resample from p without d, is NOT
    wrong: it keeps the target law for any drafter, with a lower acceptance. `verify_point_mass` relies
    on it.)
    """
    params = PARAMS[0]
    target = _probs(TARGET, params)
    right = _rejection(params)

    def target_not_residual(contexts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                            seeds: torch.Tensor, count: torch.Tensor, draft_probs: torch.Tensor | None) -> Verified:
        verified = right(contexts, drafts, num_drafts, seeds, count, draft_probs)
        width = drafts.shape[1] + 1
        fresh = keyed_categorical(target[contexts], seeds, count[:, None] + torch.arange(width), RESIDUAL_STREAM)
        spot = torch.arange(width)[None, :] == (verified.num_emitted - 1)[:, None]
        return Verified(torch.where(spot, fresh, verified.token_ids), verified.num_emitted)

    def wrong_draft_probs(contexts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                          seeds: torch.Tensor, count: torch.Tensor, draft_probs: torch.Tensor | None) -> Verified:
        assert draft_probs is not None  # told q is uniform: p/q and the residual are computed with it
        return right(contexts, drafts, num_drafts, seeds, count, torch.full_like(draft_probs, 1 / VOCAB))

    for wrong in (target_not_residual, wrong_draft_probs):
        samples = _generate(ROWS, 2, params, wrong, model_drafts=True)
        statistic, critical = _chi_square(samples, _exact_joint(params))
        assert statistic > 3 * critical, wrong.__name__


@pytest.mark.parametrize("params", PARAMS)
def test_point_mass_verification_is_the_non_speculative_output(params: Params) -> None:
    """Deterministic drafts verified by the sampler's own keyed draws: token for token the plain run."""
    rows = 2000
    assert _generate(rows, 3, params, _point_mass(params), model_drafts=False).tolist() == _plain(rows, params).tolist()
