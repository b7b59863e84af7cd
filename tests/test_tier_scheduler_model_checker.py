"""Model checking the scheduler with KV tiers: retract / restore / spill / host hit / session TTL expiry.

The search of `test_model_checker.py` (every interleaving of submit / step /
finish / abort, deduplicated by a fingerprint) on a scheduler with a host
tier, `preemption_mode="retract"` and session retention, plus a move that
advances the clock past a session's TTL. After every move it proves what the
plain checker proves (books balance on the device, handles match refcounts,
every row reads back its true history through the `SimulatedExecutor`, which
now also runs the copies between the device and a simulated host pool,
streams equal the unpressured run, liveness) and, across tiers, the books of
the host pool and every in-flight copy (`KVCache.check_invariants`), and that
a retracted request never claims computed tokens. Disk-tier interleavings are
model-checked at the kvcache level (`test_kvcache_tier_model_checker.py`).

The worlds are bounded (`MAX_STATES`) so each search stays well under a
minute on a loaded 2-core machine; the number of states explored is printed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from tests.kv_tier_sim import FakeClock, layout
from tests.test_model_checker import (
    Actions,
    Reference,
    Spec,
    World,
    _abort,
    _finish,
    do_step,
    explore,
)
from tests.test_overlap_model_checker import OverlapWorld, overlap_actions
from tokenspeed.kvcache import KVTierConfig
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.fsm import Retracted
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor

VOCAB = 4
TTL = 5.0
MAX_STATES = 20_000


@dataclass(frozen=True)
class SessionSpec(Spec):
    session: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, stop_token_ids=list(self.stop), seed=None,
                              cache_session=self.session)


class TierWorld(World):
    clock: FakeClock

    def extra_key(self) -> tuple[object, ...]:
        s = self.scheduler
        kv = s.kv
        assert kv.host is not None
        host = kv.host.pool
        retracted = []
        for request in s.retracted():
            state = request.state
            assert isinstance(state, Retracted)
            r = state.retraction
            slots = () if r.host_table is None else tuple(r.host_table.pages)
            retracted.append((request.request_id, tuple(request.output_token_ids), r.num_computed_tokens,
                              tuple(r.shared), slots, request.seed, request.num_cached_tokens))
        free = set(host._free)
        host_content = tuple(tuple(self.executor._host.get(p, ())) if p not in free else ()
                             for p in range(host.num_pages))
        return (
            tuple(retracted),
            tuple(host._refcount),
            tuple(host._free),
            tuple(host._lru),
            tuple(host._kept),
            tuple(sorted(kv.host.index._page_of.items())),
            host_content,
            tuple(sorted(kv.pool._retention.items())),
            self.clock.now,
        )


def tier_config(num_pages: int, host_slots: int) -> SchedulerConfig:
    lay = layout(2)
    return SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=4,
        max_model_len=8,
        page_size=2,
        num_pages=num_pages,
        kv_tiers=KVTierConfig(layout=lay, host_kv_cache_bytes=host_slots * lay.bytes_per_page, session_ttl=TTL),
        preemption_mode="retract",
        writeback_pages_per_step=2,
    )


def new_tier_world(config: SchedulerConfig, world_type: type[TierWorld] = TierWorld) -> World:
    clock = FakeClock()
    scheduler = Scheduler(config, clock=clock)
    executor = SimulatedExecutor(config.num_pages, config.page_size, VOCAB, history=scheduler.token_history)
    world = world_type(scheduler, executor)
    world.clock = clock
    return world


def tier_step(world: World, reference: Reference) -> None:
    """A step, noting which tier mechanisms it exercised."""
    s = world.scheduler
    before = copy.copy(s.kv.counters)
    retractions = s.num_retractions
    do_step(world, reference)
    after = s.kv.counters
    if s.num_retractions > retractions:
        world.events.add("retract")
    for event, name in (("restore", "pages_restored"), ("reacquire", "pages_reacquired"),
                        ("spill", "pages_spilled"), ("host hit", "host_hit_pages"),
                        ("retention eviction", "retention_evictions")):
        if getattr(after, name) > getattr(before, name):
            world.events.add(event)
    s.kv.check_invariants()
    for request in s.retracted():
        assert request.num_computed_tokens == 0


def _expire(world: World) -> None:
    assert isinstance(world, TierWorld)
    world.clock.now += TTL + 1.0
    world.events.add("ttl expiry")


def tier_moves(world: World, specs: list[Spec], reference: Reference) -> Actions:
    s = world.scheduler
    found: Actions = [("step", partial(tier_step, reference=reference))]
    if world.submitted < len(specs):
        spec = specs[world.submitted]

        def submit(w: World, spec: Spec = spec) -> None:
            w.scheduler.submit(spec.request_id, list(spec.prompt), spec.sampling())
            w.submitted += 1

        found.append((f"submit {spec.request_id}", submit))
    for stream_id in sorted(r.request_id for r in s.running() + s.waiting() + s.retracted()):
        found.append((f"abort {stream_id}", partial(_abort, stream_id=stream_id)))
        if stream_id in {r.request_id for r in s.retracted()}:
            found.append((f"finish {stream_id}", partial(_finish, stream_id=stream_id)))
    if s.kv.pool.num_retained and isinstance(world, TierWorld) and world.clock.now < TTL:
        found.append(("expire", _expire))
    return found


def test_every_interleaving_with_retraction_and_a_host_tier() -> None:
    specs: list[Spec] = [
        SessionSpec("a", (1, 2, 3), max_tokens=2, session="s"),
        Spec("b", (1, 2, 3, 4, 5), max_tokens=2),
        Spec("x", (3, 3, 3, 3, 3), max_tokens=1),  # evicts what the others left on the device
        SessionSpec("c", (1, 2, 3, 1), max_tokens=2, session="s"),
    ]
    states, coverage = explore(tier_config(num_pages=4, host_slots=4), specs, liveness_bound=80,
                               moves=tier_moves, make_world=new_tier_world, max_states=MAX_STATES)
    print(f"tier scheduler model checker: {states} states, coverage {sorted(coverage)}")
    assert states > 500
    assert {"retract", "restore", "spill", "host hit", "ttl expiry"} <= coverage


def test_every_interleaving_when_the_host_is_too_small_to_save_everything() -> None:
    specs: list[Spec] = [Spec("a", (1, 2, 3), max_tokens=3), Spec("b", (3, 2, 1, 0, 1), max_tokens=3)]
    states, coverage = explore(tier_config(num_pages=4, host_slots=1), specs, liveness_bound=80,
                               moves=tier_moves, make_world=new_tier_world, max_states=MAX_STATES)
    print(f"tier scheduler model checker, one host slot: {states} states")
    assert states > 50 and "retract" in coverage


# ---- tiers with overlap: a plan is built before the previous plan's copies are confirmed ------------


class TierOverlapWorld(OverlapWorld, TierWorld):
    def settled(self) -> bool:
        """Every request finished and reported, and nothing in flight: with a host tier smaller than the
        device's cached pages an idle scheduler used to keep emitting write-back forever (issue 13; see
        `test_an_idle_scheduler_stops_writing_back`), so liveness here also proves write-back converges."""
        return OverlapWorld.settled(self)

    def extra_key(self) -> tuple[object, ...]:
        kv = self.scheduler.kv
        assert kv.host is not None
        in_flight = sorted((op.kind.value, op.device_page, op.host_slot) for op in kv.copies.in_flight())
        return (*OverlapWorld.extra_key(self), *TierWorld.extra_key(self), tuple(kv.pool._pins),
                tuple(kv.host.pool._pins), tuple(in_flight))


def new_tier_overlap_world(config: SchedulerConfig) -> World:
    return new_tier_world(config, TierOverlapWorld)


def _with_tier_events(move: Callable[[World], None], world: World) -> None:
    """`move`, noting which tier mechanisms it exercised (as `tier_step` does)."""
    s = world.scheduler
    before = copy.copy(s.kv.counters)
    retractions = s.num_retractions
    move(world)
    if s.num_retractions > retractions:
        world.events.add("retract")
    for event, name in (("restore", "pages_restored"), ("spill", "pages_spilled"), ("host hit", "host_hit_pages")):
        if getattr(s.kv.counters, name) > getattr(before, name):
            world.events.add(event)
    s.kv.check_invariants()


def tier_overlap_moves(world: World, specs: list[Spec], reference: Reference) -> Actions:
    """The engine's overlapped step (the one liveness follows), its synchronous fallback, a bare resolve,
    then submit / abort between any of them."""
    found: Actions = [(name, partial(_with_tier_events, move)) for name, move in overlap_actions(world, specs, reference)
                      if name in ("step", "sync step", "resolve")]
    return found + [move for move in tier_moves(world, specs, reference) if move[0] != "step"]


def test_every_overlapped_interleaving_with_a_host_tier_smaller_than_the_cached_pages() -> None:
    """Issue 13: two finished prompts leave more cached device pages (4) than the host's 3 slots hold, so
    write-back churns (each copy evicts the slot of a page still cached on the device). With overlap a
    plan is built while the previous plan's write-back still pins cached pages, and "c", whose prompt
    needs every device page at once, was never admitted. Liveness (overlapped steps alone finish every
    request) fails without the rule that a step in which a request waits for copy-held pages emits no
    write-back."""
    specs: list[Spec] = [Spec("a", (1, 2, 2, 2), max_tokens=1), Spec("b", (0, 3, 2, 3), max_tokens=1),
                         Spec("c", (3, 3, 0, 2, 1, 2, 2), max_tokens=1)]
    config = replace(tier_config(num_pages=4, host_slots=3), max_num_batched_tokens=8)
    states, coverage = explore(config, specs, liveness_bound=80, moves=tier_overlap_moves,
                               make_world=new_tier_overlap_world, max_states=MAX_STATES)
    print(f"tier scheduler model checker with overlap, three host slots: {states} states, coverage {sorted(coverage)}")
    assert states > 100 and "spill" in coverage
