"""Scheduler behaviour against `SimulatedExecutor` (which checks every row's KV pages hold its history)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.kvcache import KVCache, StaleBlockTable
from tokenspeed.scheduler import (
    Admit,
    ChunkDone,
    Decoding,
    ExecutionPlan,
    Finish,
    Finished,
    IllegalTransition,
    Preempt,
    PrefillDone,
    Prefilling,
    RequestUpdate,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Waiting,
    transition,
)
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor


def make(
    *,
    num_pages: int = 64,
    page_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 128,
    caching: bool = True,
    seed: int = 0,
) -> tuple[Scheduler, SimulatedExecutor]:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        enable_prefix_caching=caching,
        seed=seed,
    )
    scheduler = Scheduler(config)
    return scheduler, SimulatedExecutor(num_pages, page_size, history=scheduler.token_history)


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: int = 0


def step(s: Scheduler, ex: SimulatedExecutor) -> tuple[ExecutionPlan, list[RequestUpdate]]:
    plan = s.next_plan()
    updates = [] if plan.is_empty() else s.advance(plan, ex.run(plan))
    s.check_invariants()
    return plan, updates


def collect(streams: dict[str, Stream], updates: list[RequestUpdate]) -> None:
    for u in updates:
        out = streams.setdefault(u.request_id, Stream())
        out.tokens += u.new_token_ids
        out.num_cached_tokens = u.num_cached_tokens
        out.prompt_logprobs += len(u.new_prompt_logprobs or [])
        if u.finished:
            out.finish_reason, out.stop_reason = u.finish_reason, u.stop_reason


def run_all(s: Scheduler, ex: SimulatedExecutor, max_steps: int = 2000) -> dict[str, Stream]:
    streams: dict[str, Stream] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            assert s.kv.stats().referenced == 0
            return streams
        collect(streams, step(s, ex)[1])
    raise AssertionError("requests did not finish")


def params(**kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 8)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)  # type: ignore[arg-type]


# ---- configuration and submission ---------------------------------------------------------


def test_config_rejects_a_pool_too_small_for_one_request() -> None:
    with pytest.raises(ValueError, match=r"num_pages=3 .* max_model_len=16.* 4 pages"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, page_size=4, num_pages=3)
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, page_size=0, num_pages=3)


def test_submit_validates() -> None:
    s, _ = make(max_model_len=32, max_num_seqs=2)
    with pytest.raises(InvalidRequest, match="at least one token"):
        s.submit("a", [], params())
    s.submit("a", [1, 2], params())
    with pytest.raises(InvalidRequest, match="already in use"):
        s.submit("a", [1, 2], params())
    with pytest.raises(ContextTooLong, match=r"32 tokens .* max_model_len is 32"):
        s.submit("b", list(range(32)), params())
    with pytest.raises(InvalidRequest, match="n=2: the scheduler runs one sample per request"):
        s.submit("c", [1], params(n=2))  # the front end fans it out (engine/fan_out.py)
    s.submit("d", [1], params())
    assert s.num_waiting == 2 and s.has_unfinished()


# ---- the state machine ----------------------------------------------------------------------


def test_every_illegal_event_raises_and_tables_move() -> None:
    kv = KVCache(num_pages=8, page_size=4)

    def states() -> dict[str, object]:
        return {
            "waiting": Waiting(),
            "prefilling": Prefilling(kv.new_block_table()),
            "decoding": Decoding(kv.new_block_table()),
            "finished": Finished("stop"),
        }

    def events() -> dict[str, object]:
        return {
            "admit": Admit(kv.new_block_table()),
            "chunk": ChunkDone(),
            "prefill_done": PrefillDone(),
            "preempt": Preempt(),
            "finish": Finish("abort"),
        }

    legal = {
        ("waiting", "admit"): Prefilling, ("waiting", "finish"): Finished,
        ("prefilling", "chunk"): Prefilling,
        ("prefilling", "prefill_done"): Decoding, ("prefilling", "preempt"): Waiting,
        ("prefilling", "finish"): Finished, ("decoding", "preempt"): Waiting, ("decoding", "finish"): Finished,
    }
    for state_name in states():
        for event_name in events():
            state, event = states()[state_name], events()[event_name]
            expected = legal.get((state_name, event_name))
            if expected is None:
                with pytest.raises(IllegalTransition, match=type(state).__name__):
                    transition(state, event)  # type: ignore[arg-type]
            else:
                result = transition(state, event)  # type: ignore[arg-type]
                assert type(result.state) is expected, (state_name, event_name)
                if isinstance(state, (Prefilling, Decoding)):
                    with pytest.raises(StaleBlockTable):
                        state.table.pages  # noqa: B018  the old state's handle is dead
                for table in result.dropped:
                    table.release()
    gc_tables = [t for t in kv.pool.live_holders()]
    for table in gc_tables:  # handles of states/events not consumed above
        table.release()
    kv.check_invariants()


# ---- batching ------------------------------------------------------------------------------------


def test_chunked_prefill_respects_the_budget_and_mixes_with_decodes() -> None:
    s, ex = make(budget=8)
    s.submit("short", [1, 2, 3], params(max_tokens=20))
    step(s, ex)
    s.submit("long", list(range(10, 30)), params(max_tokens=2))
    plans = [step(s, ex)[0] for _ in range(3)]
    for plan in plans:
        assert plan.num_tokens <= 8
        assert [(r.request_id, len(r.input_token_ids)) for r in plan.rows][0] == ("short", 1)
    long_rows = [r for p in plans for r in p.rows if r.request_id == "long"]
    assert [len(r.input_token_ids) for r in long_rows] == [7, 7, 6]
    assert [r.start_position for r in long_rows] == [0, 7, 14]
    assert [r.sample for r in long_rows] == [False, False, True]
    assert isinstance(s.get("long").state, Decoding)  # type: ignore[union-attr]
    run_all(s, ex)


def test_admission_is_bounded_by_max_num_seqs_and_free_pages() -> None:
    s, ex = make(max_num_seqs=2)
    for i in range(3):
        s.submit(f"r{i}", [i] * 5, params())
    plan, _ = step(s, ex)
    assert [r.request_id for r in plan.rows] == ["r0", "r1"] and s.num_waiting == 1

    s, ex = make(num_pages=8, max_model_len=32)
    for i in range(3):
        s.submit(f"r{i}", list(range(i * 100, i * 100 + 12)), params())  # 3 pages each
    plan, _ = step(s, ex)
    assert [r.request_id for r in plan.rows] == ["r0", "r1"]
    assert s.num_preemptions == 0 and s.num_waiting == 1
    assert {u for u in run_all(s, ex)} == {"r0", "r1", "r2"}


def test_queue_time_runs_from_submit_to_first_admission_and_is_reported_once() -> None:
    """What `tokenspeed_request_queue_time_seconds` shows: the wait for a slot, on the first tokens' update."""
    now = [100.0]
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128, page_size=4, num_pages=64)
    s = Scheduler(config, clock=lambda: now[0])
    ex = SimulatedExecutor(64, 4, history=s.token_history)
    s.submit("a", [1] * 5, params(max_tokens=2))
    s.submit("b", [2] * 5, params(max_tokens=2))
    now[0] += 0.5
    reported: dict[str, list[float | None]] = {"a": [], "b": []}
    while s.has_unfinished():
        for update in step(s, ex)[1]:
            if update.new_token_ids:
                reported[update.request_id].append(update.queue_time_s)
        now[0] += 1.0
    # a is admitted at 100.5; b waits for a's two steps (a slot): admitted at 102.5.
    assert reported == {"a": [0.5, None], "b": [2.5, None]}


def test_prefix_reuse_across_turns_and_same_output_without_cache() -> None:
    prefix = list(range(1000, 1200))
    results = {}
    for caching in (True, False):
        s, ex = make(num_pages=200, page_size=16, max_model_len=512, caching=caching)
        s.submit("turn1", prefix + [7, 7, 7], params(seed=1))
        first = run_all(s, ex)
        s.submit("turn2", prefix + [8, 9], params(seed=1))
        second = run_all(s, ex)
        results[caching] = (first, second)
    (first, second), (plain_first, plain_second) = results[True], results[False]
    assert first["turn1"].num_cached_tokens == 0
    assert second["turn2"].num_cached_tokens >= 200 - 16
    assert plain_second["turn2"].num_cached_tokens == 0
    assert first["turn1"].tokens == plain_first["turn1"].tokens
    assert second["turn2"].tokens == plain_second["turn2"].tokens


def test_whole_prompt_cached_still_computes_the_last_token() -> None:
    s, ex = make(page_size=4)
    s.submit("a", list(range(8)), params(max_tokens=1))
    run_all(s, ex)
    s.submit("b", list(range(8)), params(max_tokens=1))
    plan, _ = step(s, ex)
    (row,) = plan.rows
    assert row.start_position == 4 and row.input_token_ids == [4, 5, 6, 7] and row.sample
    assert s.kv.stats().referenced == 0


def test_lru_evicts_the_oldest_released_prefix_first() -> None:
    s, ex = make(num_pages=16, page_size=4, max_model_len=64)
    a, b = list(range(100, 116)), list(range(200, 216))
    for rid, prompt in (("a", a), ("b", b)):
        s.submit(rid, prompt, params(max_tokens=1))
        run_all(s, ex)
    s.submit("big", list(range(300, 340)), params(max_tokens=1))  # 10 pages: 8 free + 2 evicted
    run_all(s, ex)
    hit_a, hit_b = s.kv.match_prefix(a + [0], 4), s.kv.match_prefix(b + [0], 4)
    assert (len(hit_a), len(hit_b)) == (2, 4)  # a's two leaf pages went first
    hit_a.release()
    hit_b.release()


def test_rows_carry_only_new_pages_and_plans_release_tables() -> None:
    s, ex = make(page_size=4)
    s.submit("a", list(range(6)), params(max_tokens=8))
    (row,) = step(s, ex)[0].rows
    assert (row.first_new_page, len(row.new_page_ids)) == (0, 2)
    # Decodes at positions 6 and 7 fit the two pages; position 8 takes a third.
    grown = [(r.first_new_page, r.new_page_ids) for _ in range(3) for r in step(s, ex)[0].rows]
    assert [(first, len(new)) for first, new in grown] == [(2, 0), (2, 0), (2, 1)]
    assert grown[-1][1] == s.get("a").table.pages[2:]  # type: ignore[union-attr]
    assert s.abort("a")
    s.submit("b", [1], params())
    plan, _ = step(s, ex)
    assert plan.released_request_ids == ["a"] and [r.first_new_page for r in plan.rows] == [0]
    assert step(s, ex)[0].released_request_ids == []


# ---- preemption ------------------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request() -> None:
    s, ex = make(num_pages=9, page_size=2, max_model_len=18)
    for rid in ("a", "b", "c"):
        s.submit(rid, [ord(rid)] * 4, params(max_tokens=10))
    for _ in range(3):
        step(s, ex)
    assert s.num_running == 3 and s.kv.stats().free == 0
    plan, _ = step(s, ex)  # every stream needs a new page for position 6
    assert [r.request_id for r in plan.rows] == ["a", "b"]
    assert [r.request_id for r in s.waiting()] == ["c"] and s.num_preemptions == 1


def test_newest_request_preempts_itself_when_nothing_newer_is_unscheduled() -> None:
    s, ex = make(num_pages=4, page_size=2, max_model_len=8)
    s.submit("a", [1, 2, 3], params(max_tokens=5))
    s.submit("c", [4, 5, 6, 7], params(max_tokens=5))
    step(s, ex)
    assert s.kv.stats().free == 0
    plan, _ = step(s, ex)  # a decodes at position 3 (its page 1); c needs a third page
    assert [r.request_id for r in plan.rows] == ["a"]
    assert [r.request_id for r in s.waiting()] == ["c"]


@pytest.mark.parametrize("caching", [True, False])
def test_outputs_under_memory_pressure_equal_the_unpressured_run(caching: bool) -> None:
    def run(num_pages: int) -> tuple[dict[str, Stream], int]:
        s, ex = make(num_pages=num_pages, page_size=2, max_model_len=24, budget=16, caching=caching)
        for i in range(6):
            prompt = [5, 5, 5, 5] + [i] * (3 + i)
            for k in range(2 if i == 2 else 1):  # r2 stands for an n = 2 request, fanned out
                s.submit(f"r{i}#{k}", prompt, params(max_tokens=12))
        return run_all(s, ex), s.num_preemptions

    relaxed, calm = run(200)
    pressured, preemptions = run(12)
    assert calm == 0 and preemptions > 0
    assert {k: v.tokens for k, v in pressured.items()} == {k: v.tokens for k, v in relaxed.items()}


# ---- requests admitted together share pages (how n > 1 children share the prompt) -----------------


def submit_children(s: Scheduler, parent: str, prompt: list[int], n: int, seed: int, **kw: object) -> list[str]:
    """What the front end sends for an n-sample request (engine/fan_out.py)."""
    ids = [f"{parent}#{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        s.submit(rid, prompt, params(seed=seed + i, **kw))
    return ids


def test_requests_admitted_in_one_step_share_the_full_prompt_pages() -> None:
    s, ex = make(page_size=4)
    ids = submit_children(s, "x", list(range(10)), 3, seed=40, max_tokens=6)
    streams: dict[str, Stream] = {}
    plan, updates = step(s, ex)
    collect(streams, updates)
    # x#0 computes the prompt; x#1 and x#2, admitted after it in the same step, read its two
    # full pages (written earlier in the step) and compute only the partial last page.
    assert [(r.request_id, r.start_position, r.seed) for r in plan.rows] == [("x#0", 0, 40), ("x#1", 8, 41), ("x#2", 8, 42)]
    assert [streams[rid].num_cached_tokens for rid in ids] == [0, 8, 8]
    tables = [s.get(rid).table.pages for rid in ids]  # type: ignore[union-attr]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert [s.kv.pool.refcount(p) for p in tables[0]] == [3, 3, 1]
    collect(streams, [u for _ in range(20) for u in step(s, ex)[1]])
    assert not s.has_unfinished()

    s, ex = make(page_size=4, caching=False)  # each computes its own copy of the prompt
    for i in range(3):
        s.submit(f"solo{i}", list(range(10)), params(seed=40 + i, max_tokens=6))
    solo = run_all(s, ex)
    assert [streams[rid].tokens for rid in ids] == [solo[f"solo{i}"].tokens for i in range(3)]


def test_a_page_aligned_prompt_recomputes_only_its_last_page() -> None:
    s, ex = make(page_size=4)
    ids = submit_children(s, "x", list(range(8)), 2, seed=3, max_tokens=3)
    plan, _ = step(s, ex)
    assert [(r.request_id, r.start_position) for r in plan.rows] == [("x#0", 0), ("x#1", 4)]
    first, second = (s.get(rid).table.pages for rid in ids)  # type: ignore[union-attr]
    assert first[0] == second[0] and first[1] != second[1]
    run_all(s, ex)


def test_without_prefix_caching_requests_admitted_together_share_nothing() -> None:
    s, ex = make(page_size=4, caching=False)
    ids = submit_children(s, "x", list(range(10)), 2, seed=3, max_tokens=3)
    plan, _ = step(s, ex)
    assert [r.start_position for r in plan.rows] == [0, 0]
    first, second = (s.get(rid).table.pages for rid in ids)  # type: ignore[union-attr]
    assert not set(first) & set(second)
    run_all(s, ex)


# ---- stopping, aborting, seeds --------------------------------------------------------------------


def test_stop_token_min_tokens_and_length() -> None:
    s, ex = make()
    s.submit("probe", [3, 1, 4], params(max_tokens=6, seed=9))
    tokens = run_all(s, ex)["probe"].tokens
    stop = tokens[2]
    first = tokens.index(stop)
    s.submit("stop", [3, 1, 4], params(max_tokens=6, seed=9, stop_token_ids=[stop]))
    s.submit("late", [3, 1, 4], params(max_tokens=6, seed=9, stop_token_ids=[stop], min_tokens=first + 2))
    s.submit("eos", [3, 1, 4], SamplingParams(max_tokens=6, seed=9, eos_token_ids=(stop,)))
    out = run_all(s, ex)
    assert out["stop"].tokens == tokens[: first + 1] and out["stop"].finish_reason == "stop"
    assert out["stop"].stop_reason == stop and out["eos"].tokens == out["stop"].tokens
    late = out["late"]
    assert late.tokens == tokens[: len(late.tokens)] and len(late.tokens) > first + 1
    assert late.finish_reason == ("stop" if late.tokens[-1] == stop else "length")
    s.submit("capped", [1] * 20, params(max_tokens=None))  # max_model_len 128 - 20
    assert len(run_all(s, ex)["capped"].tokens) == 108


def test_abort_and_finish_free_pages() -> None:
    s, ex = make()
    s.submit("a", list(range(9)), params(max_tokens=50))
    s.submit("x", list(range(6)), params(max_tokens=50))
    s.submit("w", [1], params())
    step(s, ex)
    step(s, ex)
    assert s.kv.stats().referenced > 0
    assert s.abort("x") and s.get("x") is None
    assert not s.abort("x") and not s.abort("nope")
    assert s.finish("a", "stop", "</s>") and not s.finish("a", "stop")
    assert s.abort("w")
    s.check_invariants()
    assert not s.has_unfinished() and s.kv.stats().referenced == 0
    s.submit("x", [1, 2], params())  # ids are free again
    run_all(s, ex)


def test_abort_between_plan_and_advance_drops_the_row() -> None:
    s, ex = make()
    s.submit("a", list(range(9)), params())
    s.submit("b", list(range(5)), params())
    plan = s.next_plan()
    with pytest.raises(RuntimeError, match="not advanced"):
        s.next_plan()
    assert s.abort("a")
    result = ex.run(plan)
    updates = s.advance(plan, result)
    assert [u.request_id for u in updates] == ["b"]
    s.check_invariants()
    with pytest.raises(RuntimeError, match="not the plan"):
        s.advance(plan, result)
    run_all(s, ex)


def test_seeds_are_deterministic() -> None:
    def seeds(config_seed: int) -> list[int]:
        s, _ = make(seed=config_seed)
        s.submit("a", [1], params())
        s.submit("b", [1], params(seed=7))
        s.submit("c", [1], params())
        return [r.seed for r in s.waiting()]

    assert seeds(0) == seeds(0) != seeds(1)
    assert seeds(0)[1] == 7 and len({seeds(0)[0], seeds(0)[2]}) == 2


def test_prompt_logprobs_are_returned_once_and_skip_the_prefix_cache() -> None:
    s, ex = make(budget=4)
    prompt = list(range(10))
    s.submit("warm", prompt, params(max_tokens=1))
    run_all(s, ex)
    s.submit("lp", prompt, params(prompt_logprobs=2, max_tokens=4))
    streams: dict[str, Stream] = {}
    collect(streams, step(s, ex)[1])
    collect(streams, step(s, ex)[1])
    s._preempt(s.get("lp"))  # type: ignore[arg-type]  # mid-prompt: 7 of 9 positions returned
    while s.has_unfinished():
        collect(streams, step(s, ex)[1])
    assert streams["lp"].num_cached_tokens == 0
    assert streams["lp"].prompt_logprobs == 9


# ---- requests that are not ready (their grammar compiles) -------------------------------------


def test_a_request_not_ready_is_passed_over_until_set_ready() -> None:
    s, ex = make(max_num_seqs=2)
    s.submit("held", [1, 2, 3], params(max_tokens=2), ready=False)
    s.submit("next", [4, 5, 6], params(max_tokens=2))
    streams: dict[str, Stream] = {}
    for _ in range(3):
        collect(streams, step(s, ex)[1])
    assert streams["next"].finish_reason == "length" and "held" not in streams
    assert s.num_waiting == 1 and s.get("held") is not None
    assert s.set_ready("held") and not s.set_ready("gone")
    streams.update(run_all(s, ex))
    assert streams["held"].tokens and streams["held"].finish_reason == "length"


def test_a_request_not_ready_can_be_aborted() -> None:
    s, ex = make()
    s.submit("held", [1, 2, 3], params(), ready=False)
    assert s.abort("held") and not s.has_unfinished()
    s.check_invariants()
