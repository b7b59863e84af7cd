"""The workload synthesiser: distributions hit their published targets, prefixes are reused exactly."""

from __future__ import annotations

import random

import pytest

from tokenspeed.bench import textgen
from tokenspeed.bench.agentic import NATIVE_CONTEXT, agentic_plan
from tokenspeed.bench.conversation import Conversation, TextRatios, completion_prompt, system_text
from tokenspeed.bench.distributions import sample_gap_s
from tokenspeed.bench.fixed import random_plan, swe_smith_plan
from tokenspeed.bench.metrics import percentile
from tokenspeed.bench.workload import CONTEXT_HEADROOM, cap_replies, fit_to_context


@pytest.fixture(scope="module")
def many_plans():
    """40 seeds x 25 sessions: ~17K tool turns, enough for stable p99s."""
    return [agentic_plan(25, seed) for seed in range(40)]


def _turns(plans, kind):
    return [t for p in plans for s in p.sessions for t in s.turns if t.kind == kind]


def test_tool_output_lengths_match_targets(many_plans):
    tools = [t.new_tokens for t in _turns(many_plans, "tool")]
    assert len(tools) > 10_000
    assert percentile(tools, 50) == pytest.approx(900, rel=0.08)
    assert percentile(tools, 90) == pytest.approx(5_000, rel=0.12)
    assert percentile(tools, 99) == pytest.approx(20_000, rel=0.25)


def test_reply_lengths_match_targets(many_plans):
    replies = [t.output_tokens for p in many_plans for s in p.sessions for t in s.turns]
    assert percentile(replies, 50) == pytest.approx(220, rel=0.08)
    assert percentile(replies, 90) == pytest.approx(1_500, rel=0.12)


def test_gaps_match_published_fractions(many_plans):
    gaps = [t.gap_s for t in _turns(many_plans, "tool")]
    share = lambda pred: sum(map(pred, gaps)) / len(gaps)  # noqa: E731
    assert share(lambda g: g < 1) == pytest.approx(0.86, abs=0.015)
    assert share(lambda g: g < 10) == pytest.approx(0.95, abs=0.01)
    assert share(lambda g: g > 60) == pytest.approx(0.04, abs=0.008)
    assert all(t.gap_s == 0 for t in _turns(many_plans, "task")), "a session's first turn has no gap"


def test_gap_sampler_alone_over_many_draws():
    rng = random.Random(7)
    gaps = [sample_gap_s(rng) for _ in range(50_000)]
    assert sum(g < 1 for g in gaps) / len(gaps) == pytest.approx(0.86, abs=0.006)
    assert sum(g > 60 for g in gaps) / len(gaps) == pytest.approx(0.04, abs=0.004)


def test_turn_counts_heavy_tailed_in_range(many_plans):
    turns = [len(s.turns) for p in many_plans for s in p.sessions]
    assert min(turns) >= 1 and max(turns) <= 40
    assert sum(n >= 10 for n in turns) / len(turns) > 0.97
    p10, p50, p90 = (percentile(turns, q) for q in (10, 50, 90))
    assert 14 <= p50 <= 19
    assert p90 - p50 > 2 * (p50 - p10), "the tail is on the long side"


def test_shared_prefix_and_context_growth(many_plans):
    prefixes = {p.prefix_tokens for p in many_plans}
    assert all(12_000 <= x <= 24_000 for x in prefixes) and len(prefixes) > 30
    finals = [p.final_context(s) for p in many_plans for s in p.sessions]
    assert max(finals) <= NATIVE_CONTEXT
    assert 55_000 <= percentile(finals, 50) <= 90_000
    assert 90_000 <= percentile(finals, 90) <= NATIVE_CONTEXT


def test_plan_is_a_pure_function_of_seed():
    assert agentic_plan(5, 3) == agentic_plan(5, 3)
    assert agentic_plan(5, 3) != agentic_plan(5, 4)
    # More sessions extend the list rather than reshuffling it.
    assert agentic_plan(8, 3).sessions[:5] == agentic_plan(5, 3).sessions


def test_cap_replies_shortens_only_the_long_replies():
    native = agentic_plan(6, 5)
    capped = cap_replies(native, 64)
    pairs = [(n, c) for ns, cs in zip(native.sessions, capped.sessions) for n, c in zip(ns.turns, cs.turns)]
    assert all(c.output_tokens == min(n.output_tokens, 64) and c.new_tokens == n.new_tokens for n, c in pairs)
    assert any(n.output_tokens > 64 for n, _ in pairs) and any(n.output_tokens < 64 for n, _ in pairs)


@pytest.mark.parametrize("max_context", [1024, 4096, 32_768])
def test_fit_to_context_shrinks_proportionally(max_context):
    native = agentic_plan(30, 11)
    fitted = fit_to_context(native, max_context, turn_overhead=8)
    limit = int(max_context * CONTEXT_HEADROOM)
    assert all(fitted.final_context(s, 8) <= limit for s in fitted.sessions)
    assert fitted.scale == pytest.approx(limit / NATIVE_CONTEXT)
    assert fitted.prefix_tokens == pytest.approx(native.prefix_tokens * fitted.scale, abs=1)
    # The shape survives: most sessions keep all their turns, and the prefix's share is unchanged.
    kept = sum(len(f.turns) == len(n.turns) for f, n in zip(fitted.sessions, native.sessions))
    assert kept >= 0.7 * len(native.sessions)
    first = native.sessions[0].turns[0]
    assert fitted.sessions[0].turns[0].new_tokens == max(1, round(first.new_tokens * fitted.scale))


def test_swe_smith_and_random_shapes():
    swe = swe_smith_plan(20, seed=1)
    assert all(10 <= len(s.turns) <= 15 for s in swe.sessions)
    assert {s.turns[0].new_tokens for s in swe.sessions} == {50_000}
    assert all(t.new_tokens == 800 for s in swe.sessions for t in s.turns[1:])
    assert swe.multi_turn and swe.native_context == max(swe.final_context(s) for s in swe.sessions)
    rnd = random_plan(4, turns=3, input_tokens=100, output_tokens=10)
    assert not rnd.multi_turn and rnd.total_turns() == 12
    assert rnd.prompt_tokens(rnd.sessions[0]) == [100, 100, 100], "random turns carry no history"
    small = fit_to_context(rnd, 55)
    assert small.sessions[0].turns[0].new_tokens + small.sessions[0].turns[0].output_tokens <= 49


def _play(conversation: Conversation, replies: list[str]) -> list[list[dict[str, str]]]:
    requests = []
    for reply in replies:
        requests.append(conversation.next_messages())
        conversation.add_reply(reply)
    return requests


def test_each_turn_extends_the_previous_prompt_exactly():
    plan = fit_to_context(agentic_plan(3, 5), 4096)
    ratios = TextRatios()
    prefix = system_text(5, plan.prefix_tokens, ratios)
    session = plan.sessions[0]
    replies = [f"reply {i}: def f{i}(): pass" for i in range(len(session.turns))]
    requests = _play(Conversation(plan, session, ratios, "salt", prefix), replies)
    assert requests[0][0] == {"role": "system", "content": prefix}
    for index in range(1, len(requests)):
        before, after = requests[index - 1], requests[index]
        assert after[: len(before)] == before
        assert after[len(before)] == {"role": "assistant", "content": replies[index - 1]}
        assert len(after) == len(before) + 2
        assert completion_prompt(after).startswith(completion_prompt(before) + replies[index - 1])


def test_text_is_deterministic_sized_and_salted():
    plan = fit_to_context(agentic_plan(2, 5), 8192)
    ratios = TextRatios()
    session = plan.sessions[1]
    one = _play(Conversation(plan, session, ratios, "a", "P"), ["r"] * len(session.turns))
    two = _play(Conversation(plan, session, ratios, "a", "P"), ["r"] * len(session.turns))
    other = _play(Conversation(plan, session, ratios, "b", "P"), ["r"] * len(session.turns))
    assert one == two
    assert one[-1][1:] != other[-1][1:], "another sweep point gets other session text"
    assert one[-1][0] == other[-1][0], "but the same shared prefix"
    for turn, request in zip(session.turns, one):
        assert len(request[-1]["content"]) == ratios.chars(turn.kind, turn.new_tokens)


def test_text_looks_like_code():
    text = textgen.tool_output(random.Random(3), 5000) + textgen.system_prompt(random.Random(3), 5000)
    lines = text.splitlines()
    assert len(text) == 10_000
    assert len(lines) > 80
    code_markers = ("def ", "class ", "return ", "$ ", '"type": "function"', "assert", "@@", "PASSED", "FAILED", ":")
    assert sum(any(m in line for m in code_markers) for line in lines) > 0.5 * len(lines)
    words = text.split()
    assert len(set(words)) < 0.5 * len(words), "repeated identifiers, like real code, not token soup"
