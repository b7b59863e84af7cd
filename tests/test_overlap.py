"""Overlap scheduling gives exactly the tokens, finish reasons and logprobs of the synchronous engine.

Overlap advances the scheduler with placeholder samples and resolves them to the
real ids one step later (see `scheduler/provisional.py`); these tests run the protocol on
the CPU, where it is the same code as on a GPU minus the asynchrony.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import prompts
from tests.test_fast_paths import workload
from tokenspeed import LLM, SamplingParams
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID


def outputs(folder, params, **engine_args):
    llm = LLM(str(folder), skip_tokenizer_init=True, **engine_args)
    got = llm.generate([{"prompt_token_ids": p} for p in workload()], params, use_tqdm=False)
    return llm, [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in got
    ]


@pytest.fixture(scope="module")
def folder(checkpoints):
    return checkpoints["llama"]


def _stop_token(folder) -> int:
    """A token the model really emits a few steps in, so stopping on it changes the run."""
    _, out = outputs(folder, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), disable_overlap=True)
    return out[0][0][0][5]


CASES = {
    "greedy": dict(temperature=0.0, max_tokens=20, ignore_eos=True),
    "random": dict(temperature=0.9, top_p=0.9, top_k=50, seed=5, max_tokens=20, ignore_eos=True),
    "penalties": dict(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                      presence_penalty=0.5, frequency_penalty=0.2),
    "logprobs": dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
    "n3": dict(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    "min-tokens": dict(temperature=0.0, max_tokens=16, min_tokens=8),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "engine_args",
    [dict(), dict(max_num_batched_tokens=7), dict(num_kv_pages=9, max_model_len=128, page_size=16)],
    ids=["plain", "chunk-7", "preempt"],
)
def test_overlap_matches_synchronous(folder, case, engine_args):
    kwargs = dict(CASES[case])
    if case == "min-tokens":
        kwargs["stop_token_ids"] = [_stop_token(folder)]
    params = SamplingParams(**kwargs)
    _, expected = outputs(folder, params, disable_overlap=True, **engine_args)
    llm, got = outputs(folder, params, **engine_args)
    assert llm.core.overlap
    assert got == expected


def test_stop_token_ends_streams_identically(folder):
    stop = _stop_token(folder)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    _, expected = outputs(folder, params, disable_overlap=True)
    _, got = outputs(folder, params)
    assert got == expected
    assert any(c[1] == "stop" and c[2] == stop for o in got for c in o), "the stop token should fire"


def test_abort_while_a_step_is_in_flight(folder):
    llm = LLM(str(folder), skip_tokenizer_init=True)
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=4, min_len=10, max_len=20)):
        core.add_request(str(i), p, params)
    seen: dict[str, list[int]] = {}
    for _ in range(4):
        for u in core.step():
            seen.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert core._inflight is not None, "overlap keeps one step in flight"
    assert core.abort("1")
    after: list[str] = []
    while core.has_unfinished():
        for u in core.step():
            after.append(u.request_id)
            seen.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert "1" not in after, "an aborted stream reports nothing after the abort"
    assert len(seen["0"]) == len(seen["2"]) == 30
    assert PLACEHOLDER_TOKEN_ID not in seen["0"] + seen["1"] + seen["2"]
