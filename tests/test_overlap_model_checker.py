"""Model checking overlap scheduling: provisional advance and resolve in every interleaving.

The engine's overlapped step is `plan N+1 -> launch -> resolve(N) ->
advance_provisional(N+1)`; its synchronous fallback (penalties, logprobs) is
`plan N+1 -> resolve(N) -> advance(N+1)`; draining is a bare `resolve(N)`.
The search of `test_model_checker.py` explores these three moves, interleaved
with submit / finish / abort at every point (including between a step's
provisional advance and its resolve), and after every action proves what the
synchronous search proves plus:

* placeholders: at most one per stream, always its last output token, never
  computed, never in the simulated KV (`SimulatedExecutor` raises if a row
  feeds one other than as a decode input, i.e. if one is recomputed or
  hashed), and none left once the step is resolved;
* tokens: every streamed token matches the non-overlapped reference, and a
  stream that ends by stop/length streams exactly the reference's tokens with
  the reference's finish reason;
* liveness: overlapped steps alone finish and report every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_model_checker import (
    SPECS,
    Actions,
    Reference,
    Spec,
    World,
    config,
    explore,
    plan_step,
    record,
    user_actions,
)
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.plan import ExecutionResult
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor

VOCAB = 4


@dataclass
class OverlapWorld(World):
    pending: ExecutionResult | None = None  # launched and advanced on placeholders, not resolved

    def settled(self) -> bool:
        return super().settled() and self.pending is None

    def extra_key(self) -> tuple[object, ...]:
        s = self.scheduler
        unresolved = s._unresolved
        draws = () if unresolved is None else tuple(
            (d.stream.request_id, d.position, s.get(d.stream.request_id) is d.stream, d.update.finished)
            for d in unresolved.draws
        )
        rows = () if self.pending is None else tuple(
            (r.request_id, tuple(r.sampled_token_ids)) for r in self.pending.rows
        )
        return draws, rows


def new_overlap_world(cfg: SchedulerConfig) -> World:
    scheduler = Scheduler(cfg)
    return OverlapWorld(scheduler, SimulatedExecutor(cfg.num_pages, cfg.page_size, VOCAB, history=scheduler.token_history))


def _world(world: World) -> OverlapWorld:
    assert isinstance(world, OverlapWorld)
    return world


def resolve(world: World, reference: Reference | None = None) -> None:
    """Deliver the step in flight's ids (what the engine does when a plan comes out empty)."""
    w = _world(world)
    if w.pending is not None:
        result, w.pending = w.pending, None
        record(w, w.scheduler.resolve(result), reference)


def overlapped_step(world: World, reference: Reference | None = None) -> None:
    """The engine's overlapped step: plan and launch N+1, resolve N, advance N+1 on placeholders."""
    w = _world(world)
    plan = plan_step(w)
    if plan.is_empty():
        resolve(w, reference)
        return
    result = w.executor.run(plan, w.pending)  # placeholder inputs read the step in flight
    resolve(w, reference)
    w.scheduler.advance_provisional(plan)
    w.pending = result


def synchronous_step(world: World, reference: Reference | None = None) -> None:
    """The engine's fallback for rows that need host results: resolve N, then run N+1 to completion."""
    w = _world(world)
    plan = plan_step(w)
    previous = w.pending
    resolve(w, reference)
    if not plan.is_empty():
        record(w, w.scheduler.advance(plan, w.executor.run(plan, previous)), reference)


def overlap_actions(world: World, specs: list[Spec], reference: Reference) -> Actions:
    found: Actions = [
        ("step", partial(overlapped_step, reference=reference)),
        ("sync step", partial(synchronous_step, reference=reference)),
    ]
    if _world(world).pending is not None:
        found.append(("resolve", partial(resolve, reference=reference)))
    return found + user_actions(world, specs)


EXERCISED = {"evict", "natural length", "natural stop", "preempt", "prefix hit", "same-step hit"}


@pytest.mark.slow  # ~18 s exhaustive; the smallest-pool checker stays in make test
def test_every_overlapped_interleaving_keeps_books_and_tokens() -> None:
    states, coverage = explore(config(num_pages=5), SPECS, 80, overlap_actions, new_overlap_world)
    assert states > 1000 and coverage == EXERCISED


def test_stop_token_on_the_last_allowed_token_reports_stop() -> None:
    """Length is decided on the placeholder, stop only on the real id: the reason must still be "stop"."""
    specs = [Spec("a", (1, 2), max_tokens=1, stop=(0, 1, 2, 3)), Spec("b", (3,), max_tokens=2, stop=(0, 1, 2, 3))]
    states, coverage = explore(config(num_pages=4), specs, 40, overlap_actions, new_overlap_world)
    assert "natural stop" in coverage and "natural length" not in coverage


def test_every_overlapped_interleaving_on_the_smallest_pool_without_caching() -> None:
    b = (1, 2, 3, 4, 5)
    specs = [Spec("a", (1, 2, 3), max_tokens=4), Spec("b#0", b, max_tokens=3), Spec("b#1", b, max_tokens=3), SPECS[3]]
    states, coverage = explore(config(num_pages=4, caching=False), specs, 80, overlap_actions, new_overlap_world)
    assert states > 100 and "preempt" in coverage


# ---- random operation sequences ----------------------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.lists(st.integers(0, 3), min_size=1, max_size=9),
                  st.integers(1, 3), st.integers(1, 6)),
        st.tuples(st.sampled_from(["step", "step", "sync step", "resolve"])),
        st.tuples(st.sampled_from(["abort", "finish"]), st.integers(0, 9)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_pages=st.integers(8, 12), budget=st.integers(1, 8), caching=st.booleans())
def test_random_overlapped_sequences(ops: list[tuple[object, ...]], num_pages: int, budget: int, caching: bool) -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=16, page_size=2,
                          num_pages=num_pages, enable_prefix_caching=caching)
    world = _world(new_overlap_world(cfg))
    s = world.scheduler
    submitted: list[str] = []
    moves = {"step": overlapped_step, "sync step": synchronous_step, "resolve": resolve}
    for op in ops:
        kind = op[0]
        if kind == "submit":
            prompt = [1, 2, 3, 1, *op[1]]  # type: ignore[misc]
            n, max_tokens = op[2], op[3]
            rid = f"r{len(submitted)}"
            for k in range(n):  # type: ignore[call-overload]  # the children of an n-sample request
                s.submit(f"{rid}#{k}", prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=[0]))  # type: ignore[arg-type]
            submitted.append(rid)
        elif kind in moves:
            moves[str(kind)](world)
        elif submitted:
            target = submitted[op[1] % len(submitted)]  # type: ignore[operator]
            live = [r.request_id for r in s.running() + s.waiting() if r.request_id.startswith(f"{target}#")]
            if kind == "abort":
                assert all(s.abort(child) for child in live) and not s.abort(f"{target}#0")
            elif live:
                assert s.finish(live[-1], "stop")
        s.check_invariants()
    for _ in range(200):
        if world.settled():
            break
        overlapped_step(world)
        s.check_invariants()
    assert world.settled(), "overlapped steps alone did not finish every request"
    stats = s.kv.stats()
    assert stats.referenced == 0 and stats.free + stats.cached_unreferenced == stats.total


def test_resolve_out_of_protocol_raises() -> None:
    world = _world(new_overlap_world(config(num_pages=5)))
    s = world.scheduler
    s.submit("a", [1, 2, 3], SamplingParams(max_tokens=3, seed=None))
    overlapped_step(world)
    plan = s.next_plan()
    with pytest.raises(RuntimeError, match="resolved first"):
        s.advance_provisional(plan)
    with pytest.raises(ValueError, match="does not resolve"):
        s.resolve(ExecutionResult(step_id=plan.step_id, rows=[]))
