"""Model checking the control plane: every interleaving of submit / step / finish / abort.

For a small pool (page_size 2, a handful of pages) and a few requests whose
prompts share prefixes (two with the same prompt, as the children of an n = 2
request: admitted in one step, the second reads pages the first writes in
that step), a depth-first search explores every reachable state, deduplicated by a
fingerprint of everything that influences the future (requests, queues,
refcounts, free list and LRU order, prefix index, and the simulated KV
contents of non-free pages). After EVERY action it proves:

* the page books balance: free + referenced + cached == total, no page free
  and referenced, no page free twice, no negative refcount;
* each refcount equals the number of live BlockTables holding the page, and
  the live BlockTables are exactly those the running requests own (nothing
  leaked, nothing freed twice);
* every row's block table reads back its true history (SimulatedExecutor), and
  every stream's tokens are a prefix of what it produces alone in a big pool
  (exactly that, once it ends by stop/length);
* the overlap protocol (provisional advance, then resolve) is explored the
  same way by `tests/test_overlap_model_checker.py`, which reuses this search;
* liveness: from every explored state, stepping alone finishes every request
  within a bound (the step successor of each state is itself explored, so this
  is checked on the explored graph; a step cycle fails it).

A hypothesis test then drives random operation sequences on larger configs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed.scheduler import (
    ExecutionPlan,
    RequestUpdate,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor

VOCAB = 4  # small, so the stop token 0 really comes up


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 2
    stop: tuple[int, ...] = ()

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, stop_token_ids=list(self.stop), seed=None)


@dataclass
class World:
    scheduler: Scheduler
    executor: SimulatedExecutor
    submitted: int = 0
    events: set[str] = field(default_factory=set)  # what the path exercised (coverage, not state)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # tokens streamed so far
    ended_by_user: set[str] = field(default_factory=set)  # streams finished or aborted from outside

    def settled(self) -> bool:
        """Nothing left to run or to report."""
        return not self.scheduler.has_unfinished()

    def extra_key(self) -> tuple[object, ...]:
        """State a subclass adds to the fingerprint."""
        return ()


class Reference(dict[str, list[int]]):
    """Each stream's tokens alone in a roomy pool, and how each ended (`reasons`)."""

    reasons: dict[str, tuple[str | None, int | str | None]]


def new_world(config: SchedulerConfig) -> World:
    scheduler = Scheduler(config)
    return World(scheduler, SimulatedExecutor(config.num_pages, config.page_size, VOCAB, history=scheduler.token_history))


def plan_step(world: World) -> ExecutionPlan:
    """`next_plan`, noting which mechanisms it exercised."""
    s = world.scheduler
    preemptions, indexed = s.num_preemptions, s.kv.stats().indexed
    waiting = {r.request_id for r in s.waiting()}
    plan = s.next_plan()
    if s.num_preemptions > preemptions:
        world.events.add("preempt")
    if s.kv.stats().indexed < indexed:
        world.events.add("evict")
    if any(row.request_id in waiting and row.start_position > 0 for row in plan.rows):
        world.events.add("prefix hit")
    size = s.config.page_size
    written: set[int] = set()  # pages earlier rows of this plan write
    for row in plan.rows:
        request = s.get(row.request_id)
        assert request is not None and request.num_pages_sent == len(request.table) == row.num_pages
        pages = request.table.pages
        if written & set(pages[: row.start_position // size]):
            world.events.add("same-step hit")
        written |= set(pages[row.start_position // size : -(-row.end_position // size)])
    return plan


def record(world: World, updates: list[RequestUpdate], reference: Reference | None) -> None:
    """Stream `updates` out: always a prefix of the reference, all of it (and its reason) at the end."""
    for update in updates:
        assert update.request_id not in world.ended_by_user, f"{update.request_id} reported after it was ended"
        tokens = world.outputs.setdefault(update.request_id, [])
        tokens += update.new_token_ids
        assert PLACEHOLDER_TOKEN_ID not in tokens, f"{update.request_id} streamed a placeholder"
        if reference is not None:
            assert tokens == reference[update.request_id][: len(tokens)], update.request_id
        if update.finished:
            assert world.scheduler.get(update.request_id) is None, "a finished stream is still live"
            world.events.add(f"natural {update.finish_reason}")
            if reference is not None:  # ended by stop/length: exactly what it produces unpressured
                assert tokens == reference[update.request_id], update.request_id
                ending = (update.finish_reason, update.stop_reason)
                assert ending == reference.reasons[update.request_id], update.request_id


def do_step(world: World, reference: Reference | None = None) -> None:
    plan = plan_step(world)
    if not plan.is_empty():
        record(world, world.scheduler.advance(plan, world.executor.run(plan)), reference)


def reference_outputs(config: SchedulerConfig, specs: list[Spec]) -> Reference:
    """Each stream's tokens with no memory pressure (same seeds: same submission order)."""
    roomy = copy.copy(config)
    roomy.num_pages = 64
    roomy.speculation = None  # plain decoding: a speculative search must stream exactly its tokens
    world = new_world(roomy)
    tokens = Reference()
    tokens.reasons = {}
    for spec in specs:
        world.scheduler.submit(spec.request_id, list(spec.prompt), spec.sampling())
    while world.scheduler.has_unfinished():
        plan = world.scheduler.next_plan()
        for update in world.scheduler.advance(plan, world.executor.run(plan)):
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                tokens.reasons[update.request_id] = (update.finish_reason, update.stop_reason)
    assert world.scheduler.num_preemptions == 0
    return tokens


def check(world: World, reference: Reference) -> None:
    s = world.scheduler
    s.check_invariants()
    stats = s.kv.stats()
    assert stats.free + stats.referenced + stats.cached_unreferenced == stats.total
    if not s.has_unfinished():
        assert stats.referenced == 0
    assert not any(PLACEHOLDER_TOKEN_ID in slots for slots in world.executor._slots), "a placeholder reached KV"
    for request in s.running() + s.waiting():
        expected = reference[request.request_id]
        known = request.output_token_ids
        if known[-1:] == [PLACEHOLDER_TOKEN_ID]:  # sampled, not resolved yet (overlap)
            known = known[:-1]
        assert known == expected[: len(known)], request.request_id


def fingerprint(world: World) -> tuple[object, ...]:
    s = world.scheduler
    pool = s.kv.pool
    streams = []
    for request in s.running() + s.waiting():
        state = request.state
        streams.append((
            request.request_id,
            type(state).__name__,
            request.num_computed_tokens,
            tuple(request.output_token_ids),
            tuple(request.table.pages) if request.is_running else (),
            request.seed,
            request.num_cached_tokens,
        ))
    free = set(pool._free)
    kv_content = tuple(
        tuple(world.executor._slots[p]) if p not in free else () for p in range(pool.num_pages)
    )
    return (
        world.submitted,
        tuple(streams),
        tuple(pool._refcount),
        tuple(pool._free),
        tuple(pool._lru),
        tuple(sorted(s.kv.index._page_of.items())),
        kv_content,
        world.extra_key(),
    )


Actions = list[tuple[str, Callable[[World], None]]]


def actions(world: World, specs: list[Spec], reference: Reference) -> Actions:
    """Every move from `world`: a step, and whatever a user can do between steps."""
    return [("step", partial(do_step, reference=reference)), *user_actions(world, specs)]


def user_actions(world: World, specs: list[Spec]) -> Actions:
    s = world.scheduler
    found: Actions = []
    if world.submitted < len(specs):
        spec = specs[world.submitted]

        def submit(w: World, spec: Spec = spec) -> None:
            w.scheduler.submit(spec.request_id, list(spec.prompt), spec.sampling())
            w.submitted += 1

        found.append((f"submit {spec.request_id}", submit))
    live = sorted(r.request_id for r in s.running() + s.waiting())
    for stream_id in live:
        found.append((f"finish {stream_id}", partial(_finish, stream_id=stream_id)))
        found.append((f"abort {stream_id}", partial(_abort, stream_id=stream_id)))
    return found


def _finish(world: World, stream_id: str) -> None:
    assert world.scheduler.finish(stream_id, "stop", "STOP")
    world.ended_by_user.add(stream_id)


def _abort(world: World, stream_id: str) -> None:
    assert world.scheduler.abort(stream_id)
    world.ended_by_user.add(stream_id)


def explore(
    config: SchedulerConfig,
    specs: list[Spec],
    liveness_bound: int,
    moves: Callable[[World, list[Spec], Reference], Actions] = actions,
    make_world: Callable[[SchedulerConfig], World] = new_world,
    max_states: int | None = None,
) -> tuple[int, set[str]]:
    """DFS over every interleaving of `moves`; the move named "step" is the one liveness follows.
    `max_states` bounds the search (it fails past it: shrink the world rather than wait)."""
    coverage: set[str] = set()
    reference = reference_outputs(config, specs)
    root = make_world(config)
    seen: dict[tuple[object, ...], tuple[object, ...] | None] = {}  # state -> its step successor
    done: set[tuple[object, ...]] = set()
    stack: list[tuple[World, tuple[object, ...], tuple[str, ...]]] = [(root, fingerprint(root), ())]
    seen[fingerprint(root)] = None
    while stack:
        world, key, path = stack.pop()
        if world.settled():
            done.add(key)
        for name, act in moves(world, specs, reference):
            child = copy.deepcopy(world)
            try:
                act(child)
                check(child, reference)
            except AssertionError as err:
                raise AssertionError(f"after {[*path, name]}: {err}") from err
            coverage |= child.events
            child_key = fingerprint(child)
            if name == "step":
                seen[key] = child_key
            if child_key not in seen:
                seen[child_key] = None
                assert max_states is None or len(seen) <= max_states, f"more than {max_states} states"
                stack.append((child, child_key, (*path, name)))
    # Liveness on the explored graph: follow step edges to a state with nothing unfinished.
    for start in seen:
        node, steps = start, 0
        while node not in done:
            successor = seen[node]
            assert successor is not None, "a state's step successor was not explored"
            node, steps = successor, steps + 1
            assert steps <= liveness_bound, f"stepping alone does not finish within {liveness_bound} steps"
    return len(seen), coverage


def config(num_pages: int, caching: bool = True) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=4,
        max_model_len=8,
        page_size=2,
        num_pages=num_pages,
        enable_prefix_caching=caching,
    )


SPECS = [
    Spec("a", (1, 2, 3), max_tokens=3),
    Spec("b#0", (1, 2, 3, 4, 5), max_tokens=2),  # b#0 and b#1: an n = 2 request, fanned out
    Spec("b#1", (1, 2, 3, 4, 5), max_tokens=2),
    Spec("c", (1, 2), max_tokens=2, stop=(0,)),
    Spec("d", (1, 2, 3, 4), max_tokens=2),
]
EXERCISED = {"evict", "natural length", "natural stop", "preempt", "prefix hit", "same-step hit"}


def test_every_interleaving_keeps_books_and_finishes() -> None:
    states, coverage = explore(config(num_pages=5), SPECS, liveness_bound=60)
    assert states > 1000 and coverage == EXERCISED  # the search really branched into every mechanism


def test_every_interleaving_on_the_smallest_pool_without_caching() -> None:
    b = (1, 2, 3, 4, 5)
    specs = [Spec("a", (1, 2, 3), max_tokens=4), Spec("b#0", b, max_tokens=3), Spec("b#1", b, max_tokens=3), SPECS[3]]
    states, coverage = explore(config(num_pages=4, caching=False), specs, liveness_bound=60)
    assert states > 100 and "preempt" in coverage and not {"prefix hit", "same-step hit"} & coverage


# ---- random operation sequences ----------------------------------------------------------------

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=9).map(lambda t: [1, 2, 3, 1] + t)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), prompts, st.integers(1, 3), st.integers(1, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 9)),
        st.tuples(st.just("finish"), st.integers(0, 9)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_pages=st.integers(8, 12),
    budget=st.integers(1, 8),
    caching=st.booleans(),
)
def test_random_operation_sequences(ops: list[tuple[object, ...]], num_pages: int, budget: int, caching: bool) -> None:
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=16,
        page_size=2,
        num_pages=num_pages,
        enable_prefix_caching=caching,
    )
    world = new_world(cfg)
    s = world.scheduler
    submitted: list[str] = []
    for op in ops:
        kind = op[0]
        if kind == "submit":
            _, prompt, n, max_tokens = op
            rid = f"r{len(submitted)}"
            sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=[0])  # type: ignore[arg-type]
            for k in range(n):  # type: ignore[call-overload]  # the children of an n-sample request
                s.submit(f"{rid}#{k}", list(prompt), sampling)  # type: ignore[call-overload]
            submitted.append(rid)
        elif kind == "step":
            do_step(world)
        elif submitted:
            target = submitted[op[1] % len(submitted)]  # type: ignore[operator]
            live = [r.request_id for r in s.running() + s.waiting() if r.request_id.startswith(f"{target}#")]
            if kind == "abort":
                assert all(s.abort(child) for child in live) and not s.abort(f"{target}#0")
            elif live:
                assert s.finish(live[-1], "stop")
        s.check_invariants()
    for _ in range(200):
        if not s.has_unfinished():
            break
        do_step(world)
        s.check_invariants()
    assert not s.has_unfinished(), "stepping alone did not finish every request"
    stats = s.kv.stats()
    assert stats.referenced == 0 and stats.free + stats.cached_unreferenced == stats.total
