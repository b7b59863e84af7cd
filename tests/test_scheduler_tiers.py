"""The scheduler with KV tiers: retraction to the host, restore, host-tier hits, session retention.

Driven by the `SimulatedExecutor`, which runs each plan's copies on a
simulated host pool and checks that every row reads back its true history,
so a restored page holding the wrong tokens fails the run.
"""

from __future__ import annotations

import pytest

from tests.kv_tier_sim import FakeClock, layout
from tests.test_scheduler import Stream, collect, params
from tokenspeed.kvcache import KVTierConfig
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.fsm import Retracted
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor


def make(
    num_pages: int,
    *,
    host_slots: int = 0,
    mode: str | None = None,
    page_size: int = 2,
    max_model_len: int = 24,
    budget: int = 16,
    caching: bool = True,
    writeback: int = 64,
) -> tuple[Scheduler, SimulatedExecutor]:
    lay = layout(page_size)
    tiers = None if not host_slots else KVTierConfig(layout=lay, host_kv_cache_bytes=host_slots * lay.bytes_per_page)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        enable_prefix_caching=caching,
        kv_tiers=tiers,
        preemption_mode=mode,
        writeback_pages_per_step=writeback,
    )
    scheduler = Scheduler(config)
    return scheduler, SimulatedExecutor(num_pages, page_size, history=scheduler.token_history)


def run_all(s: Scheduler, ex: SimulatedExecutor, max_steps: int = 3000) -> dict[str, Stream]:
    streams: dict[str, Stream] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            assert s.kv.stats().referenced == 0
            return streams
        plan = s.next_plan()
        updates = [] if plan.is_empty() else s.advance(plan, ex.run(plan))
        s.check_invariants()
        collect(streams, updates)
    raise AssertionError("requests did not finish")


def submit_agents(s: Scheduler) -> None:
    for i in range(6):
        s.submit(f"r{i}", [5, 5, 5, 5] + [i] * (3 + i), params(max_tokens=12))


def tokens(streams: dict[str, Stream]) -> dict[str, list[int]]:
    return {k: v.tokens for k, v in streams.items()}


def test_config_resolves_and_checks_the_preemption_mode() -> None:
    assert make(64)[0].config.preemption_mode == "recompute"
    assert make(64, host_slots=8)[0].config.preemption_mode == "retract"
    assert make(64, host_slots=8, mode="recompute")[0].config.preemption_mode == "recompute"
    with pytest.raises(ValueError, match="host_kv_cache_bytes"):
        make(64, mode="retract")
    with pytest.raises(ValueError, match="preemption_mode"):
        make(64, host_slots=8, mode="swap")


@pytest.mark.parametrize("caching", [True, False])
def test_retraction_gives_the_unpressured_outputs_and_never_reprefills(caching: bool) -> None:
    relaxed, ex = make(200, caching=caching)
    submit_agents(relaxed)
    expected = tokens(run_all(relaxed, ex))

    s, ex = make(12, host_slots=64, caching=caching)
    submit_agents(s)
    got = tokens(run_all(s, ex))
    assert got == expected
    counters = s.kv.counters
    assert s.num_retractions > 0 and counters.pages_retracted > 0
    assert counters.pages_retract_lost == 0  # the host had room: nothing was recomputed
    assert counters.pages_restored + counters.pages_reacquired > 0
    if caching:  # shared / published pages stayed behind: a partial retraction moves less
        assert counters.pages_retracted < counters.pages_retracted_full
    assert s.kv.stats().draining == 0 and len(s.kv.copies) == 0


def test_recompute_and_retract_give_the_same_tokens() -> None:
    runs = {}
    for mode in ("recompute", "retract"):
        s, ex = make(12, host_slots=64, mode=mode)
        submit_agents(s)
        runs[mode] = tokens(run_all(s, ex))
        assert (s.num_retractions > 0) == (mode == "retract") and s.num_preemptions > 0
    assert runs["recompute"] == runs["retract"]


def test_a_tiny_host_tier_loses_pages_to_recompute_but_not_tokens() -> None:
    relaxed, ex = make(200)
    submit_agents(relaxed)
    expected = tokens(run_all(relaxed, ex))
    s, ex = make(12, host_slots=1, caching=False)
    submit_agents(s)
    assert tokens(run_all(s, ex)) == expected
    assert s.kv.counters.pages_retract_lost > 0


def test_aborting_a_retracted_request_frees_its_host_slots() -> None:
    s, ex = make(12, host_slots=64, caching=False)
    submit_agents(s)
    for _ in range(200):
        plan = s.next_plan()
        if not plan.is_empty():
            s.advance(plan, ex.run(plan))
        if s.retracted():
            break
    victim = s.retracted()[0]
    assert isinstance(victim.state, Retracted)
    assert s.kv.host is not None and s.kv.host.pool.num_referenced > 0
    s.abort(victim.request_id)
    s.check_invariants()
    run_all(s, ex)
    assert s.kv.host.pool.num_referenced == 0


def test_a_host_hit_loads_an_evicted_prefix_instead_of_recomputing() -> None:
    prompt = list(range(1, 13))  # 6 pages of 2
    s, ex = make(12, host_slots=32)
    s.submit("a", prompt, params(max_tokens=2))
    run_all(s, ex)
    for i in range(3):  # other prompts evict every page of "a" from the device
        s.submit(f"x{i}", [20 + i] * 12, params(max_tokens=2))
        run_all(s, ex)
    assert s.kv.counters.pages_spilled > 0
    s.submit("b", prompt, params(max_tokens=2))
    streams = run_all(s, ex)
    assert streams["b"].num_cached_tokens == 10  # all full pages but the last token's, from the host
    assert s.kv.counters.host_hit_pages > 0


@pytest.mark.parametrize("session", ["agent-a", None])
def test_a_finished_turn_reaches_the_host_before_the_next_admission_evicts_it(session: str | None) -> None:
    """Issue 13 on the H100: a waiting request admitted as a turn finished evicted that turn's pages
    before any write-back batch had copied them (device drops), so the session's next turn
    re-prefilled them. A write-back batch now goes before the admissions."""
    s, ex = make(12, host_slots=64, budget=24)
    turn = list(range(1, 17))  # 8 pages of 2
    s.submit("a1", turn, params(max_tokens=2, cache_session=session))
    s.submit("b1", [50] * 20, params(max_tokens=2))  # 11 pages: admitted once a1 is done, evicting it
    first = run_all(s, ex)
    assert s.kv.counters.device_drops == 0 and s.kv.counters.pages_spilled >= 8
    s.submit("a2", turn + first["a1"].tokens + [99], params(max_tokens=2, cache_session=session))
    assert run_all(s, ex)["a2"].num_cached_tokens == 16  # every page a1 computed, from the host
    assert s.kv.counters.host_hit_pages > 0


@pytest.mark.parametrize("session", ["agent-1", None])
def test_a_retained_session_outlives_unprotected_pages_until_its_ttl(session: str | None) -> None:
    clock = FakeClock()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=24, page_size=2,
                             num_pages=12, kv_tiers=KVTierConfig(layout=layout(2), session_ttl=30.0))
    s = Scheduler(config, clock=clock)
    ex = SimulatedExecutor(12, 2, history=s.token_history)
    turn = list(range(1, 9))
    s.submit("turn1", turn, params(max_tokens=2, cache_session=session))
    run_all(s, ex)
    assert (s.kv.pool.num_retained > 0) == (session is not None)
    for i in range(2):  # others need most of the pool: unprotected pages go first
        s.submit(f"other{i}", [30 + i] * 9, params(max_tokens=2))
        run_all(s, ex)
    s.submit("turn2", turn + [9], params(max_tokens=2))
    cached = run_all(s, ex)["turn2"].num_cached_tokens
    assert cached == 8 if session is not None else cached < 8
    clock.now += 31.0  # expired: the session's pages are plain LRU pages again
    assert s.kv.pool.num_retained == 0


def test_retracted_state_events_are_checked_and_handles_move() -> None:
    from tests.kv_tier_sim import tiered_cache
    from tokenspeed.scheduler.fsm import (
        Admit,
        ChunkDone,
        Decoding,
        Finish,
        Finished,
        IllegalTransition,
        Preempt,
        PrefillDone,
        Prefilling,
        Restore,
        Retract,
        Waiting,
        transition,
    )

    kv = tiered_cache(num_pages=8, page_size=2, host_slots=4)

    def save(table):  # type: ignore[no-untyped-def]
        return kv.retract(table, 0)

    states = {
        "waiting": lambda: Waiting(),
        "prefilling": lambda: Prefilling(kv.new_block_table()),
        "decoding": lambda: Decoding(kv.new_block_table()),
        "retracted": lambda: Retracted(save(kv.new_block_table())),
        "finished": lambda: Finished("stop"),
    }
    events = {
        "admit": lambda: Admit(kv.new_block_table()), "chunk": ChunkDone, "prefill_done": PrefillDone,
        "preempt": Preempt, "retract": lambda: Retract(save), "restore": lambda: Restore(kv.new_block_table()),
        "finish": lambda: Finish("abort"),
    }
    legal = {("prefilling", "retract"): Retracted, ("decoding", "retract"): Retracted,
             ("retracted", "restore"): Prefilling, ("retracted", "finish"): Finished}
    for state_name, make_state in states.items():
        for event_name, make_event in events.items():
            if event_name not in ("retract", "restore") and state_name != "retracted":
                continue  # the plain pairs: tests/test_scheduler.py
            state, event = make_state(), make_event()
            expected = legal.get((state_name, event_name))
            if expected is None:
                with pytest.raises(IllegalTransition, match=type(state).__name__):
                    transition(state, event)  # type: ignore[arg-type]
                continue
            result = transition(state, event)  # type: ignore[arg-type]
            assert type(result.state) is expected, (state_name, event_name)
            assert (result.retraction is not None) == (event_name == "finish")
            if result.retraction is not None:
                result.retraction.discard()
            if isinstance(result.state, Retracted):
                result.state.retraction.discard()
    for table in kv.pool.live_holders():  # handles of states/events not consumed above
        table.release()
    kv.check_invariants()


def run_overlapped(
    s: Scheduler, ex: SimulatedExecutor, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    max_steps: int = 300,
) -> dict[str, Stream]:
    """Drive `s` as the engine core does with overlap: plan N + 1 is built before plan N's result (and
    so its copies' confirmations) comes back. `arrivals[n]`: requests submitted before step n."""
    streams: dict[str, Stream] = {}
    inflight = None
    last_arrival = max(arrivals)
    for n in range(max_steps):
        for request_id, prompt, sampling in arrivals.get(n, []):
            s.submit(request_id, prompt, sampling)
        if n > last_arrival and not s.has_unfinished():
            if inflight is not None:
                collect(streams, s.resolve(inflight))
            s.check_invariants()
            assert s.kv.stats().referenced == 0
            return streams
        plan = s.next_plan()
        if plan.is_empty():
            if inflight is not None:
                collect(streams, s.resolve(inflight))
            inflight = None
            continue
        result = ex.run(plan, inflight)
        if inflight is not None:
            collect(streams, s.resolve(inflight))
        s.advance_provisional(plan)
        s.check_invariants()
        inflight = result
    pool = s.kv.pool
    raise AssertionError(
        f"no progress in {max_steps} steps: waiting {[r.request_id for r in s.waiting()]}, running "
        f"{[r.request_id for r in s.running()]}; device pages allocatable {pool.num_allocatable}, "
        f"cached {pool.num_cached_unreferenced}, pinned by copies {pool.num_pinned}"
    )


@pytest.mark.parametrize(("num_sessions", "writeback"), [(4, 2), (5, 64)])
@pytest.mark.parametrize("arrival", [4, 8])
def test_a_small_host_tier_never_starves_a_request_of_write_back_pinned_pages(
    arrival: int, num_sessions: int, writeback: int
) -> None:
    """Issue 13. The sessions' turns leave more cached device pages than the host tier (4 slots)
    holds, so each write-back batch evicts host slots of pages still cached on the device and the
    next batch copies those again: with overlap, some cached pages were always pinned when a plan
    was built, and a prompt needing 11 of the 12 device pages was never admitted. A step in which a
    request waits for copy-held pages now emits no write-back, so the copies drain."""
    turns = [(f"s{i}", [10 + i] * 4, params(max_tokens=2)) for i in range(num_sessions)]
    arrivals = {0: turns, arrival: [("long", list(range(1, 23)), params(max_tokens=2))]}
    relaxed, ex = make(200, budget=24)
    expected = tokens(run_overlapped(relaxed, ex, arrivals))
    s, ex = make(12, host_slots=4, budget=24, writeback=writeback)
    assert tokens(run_overlapped(s, ex, arrivals)) == expected
    assert s.kv.counters.pages_spilled > 0  # the write-back did run
    for _ in range(4):  # idle: the copies still in flight land, nothing leaks
        plan = s.next_plan()
        if not plan.is_empty():
            s.advance(plan, ex.run(plan))
    s.check_invariants()
    assert s.kv.stats().referenced == 0 and s.kv.stats().draining == 0
    assert len(s.kv.copies) == 0 and s.kv.pool.num_pinned == 0


@pytest.mark.parametrize("writeback", [2, 64])
def test_an_idle_scheduler_stops_writing_back(writeback: int) -> None:
    """Issue 13: finished turns leave more cached device pages (12) than the host tier holds (4 slots).
    Write-back used to evict host copies of pages still cached on the device and copy them back the
    next step, so an engine with nothing to do kept copying (about 3,000 copies in 1,000 idle steps).
    Now the idle scheduler makes at most one copy per host slot, then plans nothing."""
    s, ex = make(12, host_slots=4, budget=24, writeback=writeback)
    for i in range(6):
        s.submit(f"s{i}", [10 + i] * 4, params(max_tokens=2))
    run_all(s, ex)
    assert s.kv.pool.num_cached_unreferenced > 4
    spilled = s.kv.counters.pages_spilled
    copies = []
    for _ in range(1000):
        plan = s.next_plan()
        copies.append(len(plan.copies))
        if not plan.is_empty():
            s.advance(plan, ex.run(plan))
    s.check_invariants()
    assert sum(copies) <= 4 and not any(copies[4:]), f"{sum(copies)} copies in 1000 idle steps"
    assert s.kv.counters.pages_spilled - spilled == sum(copies)
    assert len(s.kv.copies) == 0 and s.kv.pool.num_pinned == 0
