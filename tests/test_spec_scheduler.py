"""Speculative rows in the scheduler, run against `SimulatedExecutor` (which verifies drafts like a real
verifier and checks every row's pages hold its history, drafts included, and that rejected drafts are
rolled back exactly)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

import pytest

from tokenspeed.scheduler import ExecutionPlan, SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID, ExecutionResult, RowOutput
from tokenspeed.scheduler.provisional import placeholder_result
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor
from tokenspeed.scheduler.speculation import DraftPolicy
from tokenspeed.spec import NgramDrafter, SuffixDrafter

VOCAB = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def hashed(*values: int) -> int:
    return int.from_bytes(blake2b(repr(values).encode(), digest_size=8).digest(), "little")


@dataclass
class OracleDrafter:
    """Proposes the simulated model's greedy tokens, made wrong where `wrong(history, i)` says."""

    executor: SimulatedExecutor
    wrong: Callable[[list[int], int], bool] = lambda history, i: False
    calls: list[tuple[str, int]] = field(default_factory=list)
    released: dict[str, list[int]] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return "oracle"

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        assert PLACEHOLDER_TOKEN_ID not in output, "a host drafter was handed a placeholder"
        self.calls.append((request_id, max_tokens))
        history = [*prompt, *output]
        drafts: list[int] = []
        for i in range(max_tokens):
            token = self.executor.model_token([*history, *drafts], greedy=True)
            drafts.append((token + 1) % VOCAB if self.wrong(history, i) else token)
        return drafts

    def release(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.released[request_id] = list(output)


def make(drafter: object = None, *, k: int = 3, on_device: bool = False, adaptive: bool = False,
         budget: int = 64, num_pages: int = 64, page_size: int = 4, max_model_len: int = 128,
         caching: bool = True, speculation: bool = True, **policy: object) -> tuple[Scheduler, SimulatedExecutor]:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len, page_size=page_size,
        num_pages=num_pages, enable_prefix_caching=caching,
        speculation=DraftPolicy("test", k, on_device=on_device, adaptive=adaptive, **policy) if speculation else None,  # type: ignore[arg-type]
    )
    executor = SimulatedExecutor(num_pages, page_size, VOCAB)
    if isinstance(drafter, type) or (callable(drafter) and not hasattr(drafter, "propose")):  # a factory
        drafter = drafter(executor)
    scheduler = Scheduler(config, drafter)  # type: ignore[arg-type]
    executor.check_against(scheduler.token_history)
    return scheduler, executor


def run(s: Scheduler, ex: SimulatedExecutor, prompts: dict[str, list[int]],
        params: SamplingParams | dict[str, SamplingParams] = GREEDY, max_steps: int = 500,
        on_plan: Callable[[ExecutionPlan], None] | None = None) -> dict[str, list[int]]:
    """Submit, step to the end (checking books after every step); each request's tokens."""
    for request_id, prompt in prompts.items():
        s.submit(request_id, list(prompt), params[request_id] if isinstance(params, dict) else params)
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        plan = s.next_plan()
        if on_plan is not None:
            on_plan(plan)
        for update in s.advance(plan, ex.run(plan)):
            outputs[update.request_id] += update.new_token_ids
        s.check_invariants()
        stats = s.kv.stats()
        assert stats.free + stats.referenced + stats.cached_unreferenced == stats.total
    assert not s.has_unfinished() and s.kv.stats().referenced == 0
    return outputs


PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 6], "c": [7, 7, 1, 2, 3, 4, 5, 6, 7]}


def baseline(params: SamplingParams = GREEDY, **kwargs: object) -> dict[str, list[int]]:
    s, ex = make(speculation=False, **kwargs)  # type: ignore[arg-type]
    return run(s, ex, PROMPTS, params)


def test_perfect_drafts_are_all_accepted_and_need_fewer_steps() -> None:
    s, ex = make(OracleDrafter, k=3)
    assert run(s, ex, PROMPTS) == baseline()
    stats = s.speculation_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens and stats.acceptance_rate == 1.0
    plain, plain_ex = make(speculation=False)
    run(plain, plain_ex, PROMPTS)
    assert ex.num_steps < plain_ex.num_steps / 2


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=20)])
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_partially_accepted_drafts_give_the_non_speculative_tokens(params: SamplingParams, page_size: int) -> None:
    def wrong(history: list[int], i: int) -> bool:
        return hashed(len(history), i) % 3 == 0

    s, ex = make(lambda e: OracleDrafter(e, wrong), k=4, page_size=page_size, num_pages=256 // page_size)
    assert run(s, ex, PROMPTS, params) == baseline(params, page_size=page_size, num_pages=256 // page_size)
    stats = s.speculation_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_device_drafts_are_asked_of_the_executor() -> None:
    s, ex = make(k=3, on_device=True)
    plans: list[ExecutionPlan] = []
    assert run(s, ex, PROMPTS, on_plan=plans.append) == baseline()
    verify_rows = [r for p in plans for r in p.rows if r.num_draft_tokens]
    assert verify_rows and all(r.draft_token_ids == [] for r in verify_rows)
    with pytest.raises(ValueError, match="host drafter"):
        make(OracleDrafter, on_device=True)
    with pytest.raises(ValueError, match="needed"):
        make(k=3, on_device=False)


def test_rejected_drafts_free_their_pages_and_the_executor_cuts_its_table() -> None:
    """Page size 2: a row at position 5 with 4 drafts needs pages up to position 9; all rejected, it keeps 3."""
    s, ex = make(lambda e: OracleDrafter(e, lambda h, i: True), k=4, page_size=2, adaptive=False)
    s.submit("a", [1, 2, 3, 4, 5], GREEDY)
    plan = s.next_plan()
    s.advance(plan, ex.run(plan))  # prefill: 5 tokens computed, the sample uncomputed (3 pages)
    request = s.get("a")
    assert request is not None and len(request.table) == 3
    plan = s.next_plan()
    (row,) = plan.rows
    assert row.start_position == 5 and row.num_draft_tokens == 4 and row.kv_end_position == 10
    assert len(request.table) == 5 and row.num_pages == 5
    free_before = s.kv.stats().free
    (update,) = s.advance(plan, ex.run(plan))
    assert len(update.new_token_ids) == 1  # the first draft was wrong: the model's token only
    assert request.num_computed_tokens == 6 and len(request.table) == 3 and s.kv.stats().free == free_before + 2
    s.check_invariants()
    plan = s.next_plan()
    assert plan.rows[0].first_new_page == 3  # below the 5 the executor holds: it cuts its table
    s.advance(plan, ex.run(plan))


def test_pages_with_rejected_drafts_are_never_published() -> None:
    """A later request hitting the prefix cache reads the KV back (the executor checks every position)."""
    s, ex = make(lambda e: OracleDrafter(e, lambda h, i: i == 1), k=3, page_size=2)
    first = run(s, ex, {"a": [1, 2, 3]})["a"]
    again = run(s, ex, {"b": [1, 2, 3, *first[:-1]]})["b"]  # its whole history but the last token is cached
    request_b = [1, 2, 3, *first[:-1]]
    plain, plain_ex = make(speculation=False, page_size=2)
    assert again == run(plain, plain_ex, {"b": request_b})["b"]


def test_drafts_never_push_decode_rows_out_and_count_against_the_budget() -> None:
    prompts = {f"r{i}": [i + 1] for i in range(4)}
    for budget in (4, 6):
        s, ex = make(OracleDrafter, k=3, budget=budget)
        plans: list[ExecutionPlan] = []
        outputs = run(s, ex, prompts, SamplingParams(temperature=0.0, max_tokens=8), on_plan=plans.append)
        assert all(plan.num_tokens <= budget for plan in plans)
        four = [p for p in plans if len(p.rows) == 4 and all(len(r.input_token_ids) == 1 for r in p.rows)]
        assert four  # all four decode together: drafts never took a decode row's place
        # With budget 4 the decodes use it all; with 6 two draft tokens are left for them.
        drafted = [sum(r.num_draft_tokens for r in p.rows) for p in four]
        assert max(drafted) == budget - 4
        plain, plain_ex = make(speculation=False, budget=budget)
        assert outputs == run(plain, plain_ex, prompts, SamplingParams(temperature=0.0, max_tokens=8))


def test_drafts_come_before_prefill_chunks_and_take_only_free_pages() -> None:
    s, ex = make(OracleDrafter, k=3, budget=6, num_pages=40, page_size=4)
    s.submit("a", [1, 2, 3], GREEDY)
    plan = s.next_plan()
    s.advance(plan, ex.run(plan))
    s.submit("long", list(range(30)), GREEDY)
    plan = s.next_plan()
    assert [(r.request_id, r.num_scheduled_tokens) for r in plan.rows] == [("a", 4), ("long", 2)]
    s.advance(plan, ex.run(plan))
    # No free page left for drafts: the decode row runs alone, nobody is preempted.
    s2, ex2 = make(OracleDrafter, k=3, num_pages=32, page_size=4, max_model_len=128)
    s2.submit("x", list(range(1, 124)), SamplingParams(temperature=0.0, max_tokens=5))
    while True:
        plan = s2.next_plan()
        s2.advance(plan, ex2.run(plan))
        x = s2.get("x")
        if x is not None and x.output_token_ids:
            break
    assert s2.kv.pool.num_free == 1
    plan = s2.next_plan()
    assert plan.rows[0].num_draft_tokens <= 4 and s2.num_preemptions == 0
    s2.advance(plan, ex2.run(plan))


def test_drafts_stop_short_of_max_tokens_and_a_stop_token_drops_the_rest() -> None:
    s, ex = make(OracleDrafter, k=8)
    out = run(s, ex, {"a": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=5))["a"]
    assert len(out) == 5
    assert all(m <= 4 for _, m in s.speculation.drafter.calls)  # type: ignore[union-attr]
    # A stop token accepted mid-draft ends the stream there; min_tokens keeps it going before.
    full = baseline()["a"]
    stop = full[3]
    s, ex = make(OracleDrafter, k=8)
    got = run(s, ex, {"a": PROMPTS["a"]}, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]))
    assert got["a"] == full[: full.index(stop) + 1]
    s, ex = make(OracleDrafter, k=8)
    later = [i for i, t in enumerate(full) if t == stop and i >= 5]
    got = run(s, ex, {"a": PROMPTS["a"]},
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop], min_tokens=5))
    assert got["a"] == (full[: later[0] + 1] if later else full)


def test_adaptive_length_falls_to_zero_for_a_useless_drafter_and_probes() -> None:
    s, ex = make(lambda e: OracleDrafter(e, lambda h, i: True), k=4, adaptive=True, probe_interval=5)
    run(s, ex, {"a": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=40))
    calls = [m for _, m in s.speculation.drafter.calls]  # type: ignore[union-attr]
    assert calls[0] == 4 and calls[-1] == 1 and len(calls) < 15  # from k, down to probes of 1
    good, good_ex = make(OracleDrafter, k=4, adaptive=True)
    run(good, good_ex, {"a": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=40))
    assert all(m == 4 for _, m in good.speculation.drafter.calls[:-2])  # type: ignore[union-attr]


def test_no_drafts_at_or_above_disable_by_batch_size() -> None:
    s, ex = make(OracleDrafter, k=2, disable_by_batch_size=2)
    plans: list[ExecutionPlan] = []
    params = {"a": SamplingParams(temperature=0.0, max_tokens=2), "b": SamplingParams(temperature=0.0, max_tokens=9)}
    run(s, ex, {"a": [1, 2], "b": [3, 4]}, params, on_plan=plans.append)
    assert not any(p.has_drafts for p in plans if len(p.rows) >= 2)
    assert any(p.has_drafts for p in plans)  # once one request is left


def test_stats_and_release() -> None:
    drafter_box: list[OracleDrafter] = []

    def build(e: SimulatedExecutor) -> OracleDrafter:
        drafter_box.append(OracleDrafter(e, lambda h, i: i == 2))
        return drafter_box[0]

    s, ex = make(build, k=3)
    outputs = run(s, ex, {"a": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=12))
    stats = s.speculation_stats
    assert stats is not None
    # Drafts are wrong at position 2 only (the last row drafts 1 because max_tokens is near).
    assert stats.accepted_per_position == [stats.num_drafts, stats.num_drafts - 1, 0] and stats.num_drafts == 4
    assert stats.num_accepted_tokens == 7 and stats.num_draft_tokens == 10
    assert stats.mean_accepted_length == pytest.approx(1 + 7 / 4)
    assert stats.as_dict()["acceptance_rate"] == pytest.approx(0.7)
    assert drafter_box[0].released == outputs
    s.submit("b", [5], GREEDY)
    s.abort("b")
    assert drafter_box[0].released["b"] == []


def test_overlap_host_drafts_wait_for_resolved_tokens_and_verify_rows_are_synchronous() -> None:
    s, ex = make(OracleDrafter, k=3)
    s.submit("a", [1, 2, 3], GREEDY)
    plan = s.next_plan()
    result = ex.run(plan)
    s.advance_provisional(plan)  # the prefill's sample is a placeholder now
    plan2 = s.next_plan()
    assert not plan2.has_drafts  # the drafter cannot see the last token yet
    result2 = ex.run(plan2, result)
    s.resolve(result)
    s.advance_provisional(plan2)
    s.resolve(result2)
    plan3 = s.next_plan()  # built on resolved history: drafts
    assert plan3.has_drafts
    with pytest.raises(ValueError, match="verifies drafts"):
        placeholder_result(plan3)
    s.advance(plan3, ex.run(plan3))
    s.check_invariants()


def test_device_drafts_follow_an_overlapped_step() -> None:
    s, ex = make(k=2, on_device=True)
    s.submit("a", [1, 2, 3], GREEDY)
    plan = s.next_plan()
    result = ex.run(plan)
    s.advance_provisional(plan)
    plan2 = s.next_plan()
    assert plan2.rows[0].input_token_ids == [PLACEHOLDER_TOKEN_ID] and plan2.has_drafts
    result2 = ex.run(plan2, result)  # the executor reads the placeholder's token and drafts after it
    s.resolve(result)
    s.advance(plan2, result2)
    s.check_invariants()


def test_bad_verify_results_raise() -> None:
    s, ex = make(OracleDrafter, k=2)
    s.submit("a", [1, 2, 3], GREEDY)
    plan = s.next_plan()
    s.advance(plan, ex.run(plan))
    plan = s.next_plan()
    (row,) = plan.rows
    assert row.draft_token_ids
    too_many = ExecutionResult(plan.step_id, [RowOutput("a", [0] * 4)])
    with pytest.raises(ValueError, match="emits 1 to 3"):
        s.advance(plan, too_many)
    s2, ex2 = make(OracleDrafter, k=2)
    s2.submit("a", [1, 2, 3], GREEDY)
    plan = s2.next_plan()
    s2.advance(plan, ex2.run(plan))
    plan = s2.next_plan()
    wrong = (plan.rows[0].draft_token_ids[0] + 1) % VOCAB
    with pytest.raises(ValueError, match="accepted drafts"):
        s2.advance(plan, ExecutionResult(plan.step_id, [RowOutput("a", [wrong, 0])]))


@pytest.mark.parametrize("make_drafter", [lambda e: NgramDrafter(1, 3), lambda e: SuffixDrafter(max_depth=6)])
def test_real_drafters_keep_the_non_speculative_tokens(make_drafter: Callable[[SimulatedExecutor], object]) -> None:
    """A repetitive greedy stream (vocab 8) gives n-gram and suffix matches; outputs are unchanged."""
    prompts = {"a": [1, 2, 3, 1, 2, 3, 1, 2], "b": [4, 5, 4, 5, 4]}
    params = SamplingParams(temperature=0.0, max_tokens=60)
    s, ex = make(make_drafter, k=4, adaptive=True)
    plain, plain_ex = make(speculation=False)
    assert run(s, ex, prompts, params) == run(plain, plain_ex, prompts, params)
    stats = s.speculation_stats
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("on_device", [True, False])
def test_the_blind_executor_verifies_too(on_device: bool) -> None:
    """Without a history (the scheduler-overhead benchmark) it answers verify rows with 1..k+1 tokens."""
    s, _ = make(None if on_device else OracleDrafter(SimulatedExecutor(64, 4, VOCAB)), k=3, on_device=on_device)
    blind = SimulatedExecutor(64, 4, VOCAB)
    outputs = run(s, blind, PROMPTS, SamplingParams(temperature=0.0, max_tokens=20))
    stats = s.speculation_stats
    assert stats is not None and stats.num_drafts > 0 and all(len(o) == 20 for o in outputs.values())


def test_padded_verify_steps_draft_only_when_the_whole_step_pays() -> None:
    """With verify rows padded to k_max (a GPU's verify graphs), every row pays for k_max positions: a step
    drafts only when its expected tokens beat R * (1 + c * k_max). At c = 0.3 each row alone would draft 2
    (prior acceptance 0.7: 2.19 tokens for a cost of 1.6), but padded to 8 the step costs 3.4 a row: nothing
    is proposed or allocated, and the tokens stay the same. Padded to 3 at a low cost, the step drafts."""
    cheap, ex = make(OracleDrafter, k=3, adaptive=True, verify_pad_length=3, draft_token_cost=0.05)
    assert run(cheap, ex, PROMPTS) == baseline()
    assert cheap.speculation_stats is not None and cheap.speculation_stats.num_drafts > 0
    unpadded, ex = make(OracleDrafter, k=3, adaptive=True, draft_token_cost=0.3)
    assert run(unpadded, ex, PROMPTS) == baseline()
    assert unpadded.speculation_stats is not None and unpadded.speculation_stats.num_drafts > 0
    dear, ex = make(OracleDrafter, k=3, adaptive=True, verify_pad_length=8, draft_token_cost=0.3)
    assert run(dear, ex, PROMPTS) == baseline()
    assert dear.speculation_stats is not None and dear.speculation_stats.num_drafts == 0
    assert dear.speculation is not None and dear.speculation.drafter.calls == []  # type: ignore[union-attr]
    for scheduler, pays in ((make(OracleDrafter, k=3, adaptive=True, verify_pad_length=8, draft_token_cost=0.3)[0],
                             False),
                            (make(OracleDrafter, k=3, adaptive=True, verify_pad_length=3, draft_token_cost=0.05)[0],
                             True)):
        for request_id, prompt in PROMPTS.items():
            scheduler.submit(request_id, list(prompt), GREEDY)
        scheduler.next_plan()
        # What the engine core asks before resolving the step in flight: no = stay overlapped.
        assert scheduler.num_running == 3 and scheduler.may_draft() is pays


def test_no_drafts_when_the_padded_verify_step_would_leave_its_graph() -> None:
    """rows * (k_max + 1) above `max_verify_tokens`: plain decode steps (three rows of 4 tokens > 8), and
    drafts again once two rows are left."""
    plans: list[ExecutionPlan] = []
    params = {r: SamplingParams(temperature=0.0, max_tokens=n) for r, n in (("a", 4), ("b", 20), ("c", 20))}
    s, ex = make(OracleDrafter, k=3, adaptive=True, verify_pad_length=3, max_verify_tokens=8)
    s_base, ex_base = make(speculation=False)
    assert run(s, ex, PROMPTS, params, on_plan=plans.append) == run(s_base, ex_base, PROMPTS, params)
    decoding = [p for p in plans if all(r.sample for r in p.rows)]
    assert any(len(p.rows) == 3 for p in decoding)
    assert not any(p.has_drafts for p in decoding if len(p.rows) == 3)
    assert any(p.has_drafts for p in decoding if len(p.rows) == 2)
    for request_id, prompt in PROMPTS.items():
        s.submit(request_id, list(prompt), GREEDY)
    s.advance(plan := s.next_plan(), ex.run(plan))
    assert s.num_running == 3 and not s.may_draft()  # the engine core then keeps the step overlapped
    always, _ = make(OracleDrafter, k=3, adaptive=False, verify_pad_length=3, max_verify_tokens=8)
    assert always.speculation is not None and always.speculation.may_draft(3)  # the off switch
