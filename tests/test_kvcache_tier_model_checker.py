"""Model checking the KV tiers: every interleaving of cache operations and copy confirmations.

A tiny world (a few device pages, host slots and disk files; two or three
requests whose prompts share a prefix and end in a partial page) is explored
depth first over every action: match a prompt (loading host hits), compute
it, finish it with or without session retention, release it, retract it,
restore it, discard a retraction, write back, prefetch from disk, confirm ANY
copy in flight (in any order), advance the clock past a TTL, and corrupt a
disk file. States are deduplicated by a fingerprint of everything that
influences the future. After EVERY action it proves:

* the books of every tier balance and agree with the copies in flight
  (`KVCache.check_invariants`): no page both free and owned, no pinned page
  free or handed out (no slot reused while a copy reads or writes it), every
  pending page is the destination of exactly one copy;
* content (`TierSim`, where a copy's destination is garbage until it lands and
  its source is read only when it is confirmed): every landed page any tier
  indexes holds the tokens its hash stands for, every page a live request
  holds holds its tokens, every retracted private page on the host holds the
  request's tokens, and no disk file ever reads back as wrong KV;
* liveness and restore: from the state, confirming every copy, then resuming
  each retracted request alone restores a table whose KV reads back the true
  history (recomputing only what was lost), and then every page of every
  tier is free or cached again with no copy in flight.

A hypothesis test drives long random action sequences on larger worlds.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_tier_sim import (
    FakeClock,
    MemoryStore,
    TierSim,
    check_contents,
    page_tokens_by_hash,
    tiered_cache,
)
from tokenspeed.kvcache import BlockTable, KVCache, PagePool, Retraction

TTL = 10.0


@dataclass
class Req:
    tokens: tuple[int, ...]
    table: BlockTable | None = None  # running
    computed: int = 0
    retraction: Retraction | None = None  # retracted


@dataclass
class World:
    kv: KVCache
    sim: TierSim
    clock: FakeClock
    store: MemoryStore | None
    reqs: list[Req]
    known: dict[bytes, list[int]]
    max_ticks: int
    max_in_flight: int  # actions that may start copies wait while this many are in flight
    ticks: int = 0
    corrupted: bool = False
    events: set[str] = field(default_factory=set)  # what the path exercised (coverage, not state)


def new_world(
    prompts: list[tuple[int, ...]],
    num_pages: int,
    host_slots: int,
    disk_files: int,
    page_size: int = 2,
    caching: bool = True,
    max_ticks: int = 2,
    max_in_flight: int = 99,
) -> World:
    clock = FakeClock()
    store = MemoryStore() if disk_files else None
    kv = tiered_cache(
        num_pages, page_size, host_slots, disk_files, clock=clock, caching=caching, ttl=TTL, store=store
    )
    known = page_tokens_by_hash(prompts, page_size)
    return World(kv, TierSim(kv), clock, store, [Req(p) for p in prompts], known, max_ticks, max_in_flight)


# ---- actions ------------------------------------------------------------------------------------

Action = Callable[[World], None]


def _match(w: World, i: int) -> None:
    req = w.reqs[i]
    before = w.kv.counters.host_hit_pages
    req.table = w.kv.match_prefix(req.tokens, (len(req.tokens) - 1) // w.kv.page_size)
    req.computed = len(req.table) * w.kv.page_size
    if w.kv.counters.host_hit_pages > before:
        w.events.add("host hit")


def _compute(w: World, i: int) -> None:
    req = w.reqs[i]
    assert req.table is not None
    w.kv.allocate(req.table, w.kv.pages_for(len(req.tokens)) - len(req.table))
    w.sim.compute(req.table.pages, req.tokens, req.computed, len(req.tokens))
    w.kv.publish(req.table, req.tokens, len(req.tokens))
    req.computed = len(req.tokens)


def _release(w: World, i: int, retain: bool) -> None:
    req = w.reqs[i]
    assert req.table is not None
    if retain:
        w.kv.retain(req.table, f"session{i}")
    req.table.release()
    req.table, req.computed = None, 0


def _retract(w: World, i: int) -> None:
    req = w.reqs[i]
    assert req.table is not None
    if any(w.kv.pool.refcount(page) > 1 for page in req.table.pages):
        w.events.add("retract beside a live sharer")
    req.retraction = w.kv.retract(req.table, req.computed)
    req.table, req.computed = None, 0
    w.events.add("retract" if req.retraction.num_private else "retract shared only")


def _restore(w: World, i: int) -> None:
    req = w.reqs[i]
    assert req.retraction is not None
    restored = w.kv.restore(req.retraction)
    req.retraction, req.table, req.computed = None, restored.table, restored.num_computed_tokens
    if restored.pages_loaded:
        w.events.add("restore load")
    if restored.pages_reacquired:
        w.events.add("restore reacquire")


def _discard(w: World, i: int) -> None:
    req = w.reqs[i]
    assert req.retraction is not None
    req.retraction.discard()
    req.retraction = None


def _writeback(w: World) -> None:
    w.kv.writeback(max_pages=1, max_disk_pages=1)


def _prefetch(w: World, i: int) -> None:
    w.kv.prefetch(w.reqs[i].tokens, len(w.reqs[i].tokens) // w.kv.page_size)


def _confirm(w: World, op_id: int) -> None:
    counters = w.kv.counters
    hits, bad = counters.disk_hit_pages, counters.disk_bad_files
    w.sim.finish(op_id)
    if counters.disk_hit_pages > hits:
        w.events.add("disk hit")
    if counters.disk_bad_files > bad:
        w.events.add("bad disk file")


def _tick(w: World) -> None:
    w.clock.now += TTL
    w.ticks += 1
    if any(until <= w.clock.now for _, until in w.kv.pool._retention.values()):
        w.events.add("retention expired")


def _corrupt(w: World, name: str) -> None:
    assert w.store is not None
    blob = w.store.files[name]
    w.store.files[name] = blob[:-1] + bytes([blob[-1] ^ 1])
    w.corrupted = True


def actions(w: World) -> list[tuple[str, Action]]:
    """Every move from `w` (copies the kvcache emits are taken by the executor at once).

    Only request 0 retains its pages when it finishes (one session is enough to order
    retained against unprotected pages), and the engine-driven moves that start copies
    (write-back, prefetch, retract, restore) wait while `max_in_flight` copies are
    running; requests still match at any time, and confirmations interleave in every order.
    """
    kv = w.kv
    may_copy = len(w.sim.running) < w.max_in_flight
    found: list[tuple[str, Action]] = []
    for i, req in enumerate(w.reqs):
        if req.table is not None:
            grow = kv.pages_for(len(req.tokens)) - len(req.table)
            if req.computed < len(req.tokens) and kv.is_ready(req.table) and kv.can_allocate(grow):
                found.append((f"compute {i}", partial(_compute, i=i)))
            if i == 0 and req.computed == len(req.tokens) and kv.is_ready(req.table):
                found.append((f"finish+retain {i}", partial(_release, i=i, retain=True)))
            found.append((f"release {i}", partial(_release, i=i, retain=False)))
            if may_copy:
                found.append((f"retract {i}", partial(_retract, i=i)))
        elif req.retraction is not None:
            if kv.is_restorable(req.retraction) and may_copy:
                found.append((f"restore {i}", partial(_restore, i=i)))
            found.append((f"discard {i}", partial(_discard, i=i)))
        else:
            found.append((f"match {i}", partial(_match, i=i)))
            if kv.disk is not None and may_copy:
                found.append((f"prefetch {i}", partial(_prefetch, i=i)))
    if kv.host is not None and may_copy:
        found.append(("writeback", _writeback))
    for op_id in sorted(w.sim.running):
        found.append((f"confirm {op_id}", partial(_confirm, op_id=op_id)))
    if w.ticks < w.max_ticks:
        found.append(("tick", _tick))
    if w.store is not None and not w.corrupted:
        for name in sorted(w.store.files):
            found.append((f"corrupt {name[:6]}", partial(_corrupt, name=name)))
    return found


def act(w: World, action: Action) -> None:
    """Run `action`, hand its copies to the executor, note what the books show, then check everything."""
    counters = w.kv.counters
    drops, kept = counters.device_drops, counters.retention_evictions
    action(w)
    w.sim.take()
    w.sim.scrub_free_pages()
    if counters.device_drops > drops:
        w.events.add("drop")
    if counters.retention_evictions > kept:
        w.events.add("retention eviction")
    if len(w.sim.running) > 1:
        w.events.add("concurrent copies")
    check(w)


def _freeze(w: World) -> bytes:
    """A deep snapshot (pickle is several times faster than copy.deepcopy here, and compact in a queue)."""
    return pickle.dumps(w, pickle.HIGHEST_PROTOCOL)


def _thaw(frozen: bytes) -> World:
    world: World = pickle.loads(frozen)
    return world


def clone(w: World) -> World:
    return _thaw(_freeze(w))


# ---- what must hold ---------------------------------------------------------------------------


def check(w: World) -> None:
    kv, sim = w.kv, w.sim
    kv.check_invariants()
    check_contents(sim, w.known)
    size = kv.page_size
    for req in w.reqs:
        if req.table is not None:
            for position in range(req.computed):
                page = req.table.page_at(position // size)
                if not kv.pool.is_pending(page):
                    assert sim.device[page][position % size] == req.tokens[position], f"page {page} lost KV"
        if req.retraction is not None and req.retraction.host_table is not None:
            assert kv.host is not None
            private = [i for i, shared in enumerate(req.retraction.shared) if not shared]
            for i, slot in zip(private, req.retraction.host_table.held_pages(), strict=True):
                if not kv.host.pool.is_pending(slot):
                    expected = list(req.tokens[i * size : min((i + 1) * size, req.retraction.num_computed_tokens)])
                    assert sim.host[slot][: len(expected)] == expected, f"host slot {slot} lost a retracted page"


def check_drains(w: World) -> None:
    """Confirm every copy, resume each retracted request alone (its KV must read back), free everything."""
    w = clone(w)
    kv, sim = w.kv, w.sim
    sim.finish_all()
    for req in w.reqs:
        if req.table is not None:
            req.table.release()
            req.table = None
    for i, req in enumerate(w.reqs):
        if req.retraction is not None:
            _restore(w, i)
            sim.finish_all()
            assert req.table is not None and kv.is_ready(req.table)
            _compute(w, i)  # recomputes only what was lost, and reads the whole history back
            _release(w, i, retain=False)
            sim.finish_all()
    check(w)
    for pool in (kv.pool, *([] if kv.host is None else [kv.host.pool])):
        assert pool.num_referenced == 0 and pool.num_pinned == 0 and pool.num_draining == 0
        assert pool.num_free + pool.num_cached_unreferenced == pool.num_pages
    assert not kv.copies.in_flight()


# ---- the search ----------------------------------------------------------------------------------


def _pool_key(pool: PagePool) -> tuple[object, ...]:
    return (
        tuple(pool._refcount),
        tuple(pool._free),
        tuple(pool._lru),
        tuple(sorted(pool._retention.items())),
        tuple(pool._pins),
        tuple(sorted(pool._pending)),
        tuple(sorted(pool._draining)),
    )


def fingerprint(w: World) -> tuple[object, ...]:
    kv = w.kv
    host = kv.host
    disk = kv.disk
    reqs = []
    for req in w.reqs:
        r = req.retraction
        reqs.append((
            None if req.table is None else (tuple(req.table.pages), req.table.num_published),
            req.computed,
            None if r is None else (tuple(r.shared), tuple(r.host_table.pages if r.host_table else ()), r.num_computed_tokens),
        ))
    return (
        tuple(reqs),
        _pool_key(kv.pool),
        tuple(sorted(kv.index._page_of.items())),
        None if host is None else (_pool_key(host.pool), tuple(sorted(host.index._page_of.items()))),
        None if disk is None else tuple((h, e.pins, e.pending) for h, e in disk._entries.items()),
        None if w.store is None else tuple(sorted(w.store.files.items())),
        tuple((op.kind, op.device_page, op.host_slot, op.page_hash) for _, op in sorted(w.sim.running.items())),
        tuple(map(tuple, w.sim.device)),
        tuple(map(tuple, w.sim.host)),
        w.clock.now,
        w.corrupted,
    )


def explore(root: World, max_states: int) -> tuple[int, set[str]]:
    """Breadth first over every interleaving from `root` (so a failure shows a shortest path).

    Worlds wait in the queue pickled (compact), each with the path that reached it.
    Returns (states explored, coverage).
    """
    check(root)
    seen = {fingerprint(root)}
    queue: deque[tuple[bytes, tuple[str, ...]]] = deque([(_freeze(root), ())])
    coverage: set[str] = set()
    while queue:
        frozen, path = queue.popleft()
        world = _thaw(frozen)
        try:
            check_drains(world)
        except Exception as err:
            raise AssertionError(f"draining after {list(path)}: {err!r}") from err
        for name, action in actions(world):
            child = _thaw(frozen)
            try:
                act(child, action)
            except Exception as err:
                raise AssertionError(f"after {[*path, name]}: {err!r}") from err
            coverage |= child.events
            key = fingerprint(child)
            if key not in seen:
                seen.add(key)
                assert len(seen) <= max_states, f"more than {max_states} states: shrink the world"
                child.events = set()
                queue.append((_freeze(child), (*path, name)))
    return len(seen), coverage


DISJOINT: list[tuple[int, ...]] = [(1, 2, 3), (4, 5, 6)]  # on a 2-page device each evicts the other: host and disk hits
SHARED: list[tuple[int, ...]] = [(1, 2, 3), (1, 2, 4, 5, 6)]  # share page (1, 2) while both run
CORE = {"drop", "host hit", "retract", "restore load", "restore reacquire", "retention eviction"}


@pytest.mark.slow  # ~35 s exhaustive; the tier scheduler checker covers tiers in make test
def test_every_interleaving_on_all_tiers() -> None:
    world = new_world(DISJOINT, num_pages=2, host_slots=1, disk_files=1, max_ticks=1, max_in_flight=1)
    states, coverage = explore(world, max_states=60_000)
    print(f"kv tier model checker, all tiers: {states} states")
    assert coverage >= CORE | {"disk hit", "bad disk file", "retention expired"}, coverage


@pytest.mark.slow  # ~35 s exhaustive
def test_every_interleaving_with_a_prefix_shared_by_live_requests() -> None:
    world = new_world(SHARED, num_pages=3, host_slots=2, disk_files=0, max_ticks=0, max_in_flight=1)
    states, coverage = explore(world, max_states=60_000)
    print(f"kv tier model checker, shared prefix: {states} states")
    assert coverage >= CORE | {"concurrent copies", "retract beside a live sharer", "retract shared only"}, coverage


def test_every_interleaving_of_full_retraction_without_caching() -> None:
    prompts = [SHARED[0], DISJOINT[1]]
    world = new_world(prompts, num_pages=3, host_slots=2, disk_files=0, caching=False, max_ticks=0, max_in_flight=2)
    states, coverage = explore(world, max_states=30_000)
    print(f"kv tier model checker, no prefix caching: {states} states")
    assert {"retract", "restore load", "concurrent copies"} <= coverage and "host hit" not in coverage


# ---- random action sequences ---------------------------------------------------------------------

token_lists = st.lists(st.integers(1, 3), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tails=st.lists(token_lists, min_size=2, max_size=3),
    num_pages=st.integers(4, 7),
    host_slots=st.integers(0, 5),
    disk_files=st.integers(0, 3),
    caching=st.booleans(),
    choices=st.lists(st.integers(0, 10_000), max_size=60),
)
def test_random_action_sequences(
    tails: list[list[int]], num_pages: int, host_slots: int, disk_files: int, caching: bool, choices: list[int]
) -> None:
    prompts = [(1, 2, *tail) for tail in tails]
    if host_slots == 0:
        disk_files = 0
    world = new_world(prompts, num_pages, host_slots, disk_files, page_size=2, caching=caching, max_ticks=3)
    for choice in choices:
        moves = actions(world)
        name, action = moves[choice % len(moves)]
        try:
            act(world, action)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
    check_drains(world)
