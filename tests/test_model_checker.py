"""Model checking the control plane: every interleaving of submit / step / finish / abort.

For a small pool (page_size 2, a handful of pages) and a few requests whose
prompts share prefixes (one with n = 2, so forks and page copies happen), a
depth-first search explores every reachable state, deduplicated by a
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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed.errors import ContextTooLong
from tokenspeed.scheduler import Prefilling, SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor

VOCAB = 4  # small, so the stop token 0 really comes up


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    n: int = 1
    max_tokens: int = 2
    stop: tuple[int, ...] = ()

    def sampling(self) -> SamplingParams:
        return SamplingParams(n=self.n, max_tokens=self.max_tokens, stop_token_ids=list(self.stop), seed=None)


@dataclass
class World:
    scheduler: Scheduler
    executor: SimulatedExecutor
    submitted: int = 0
    events: set[str] = field(default_factory=set)  # what the path exercised (coverage, not state)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # tokens streamed so far


def new_world(config: SchedulerConfig) -> World:
    return World(Scheduler(config), SimulatedExecutor(config.num_pages, config.page_size, VOCAB))


def do_step(world: World, reference: dict[str, list[int]] | None = None) -> None:
    s = world.scheduler
    preemptions, indexed = s.num_preemptions, s.kv.stats().indexed
    waiting = {r.request_id for r in s.waiting()}
    plan = s.next_plan()
    if s.num_preemptions > preemptions:
        world.events.add("preempt")
    if s.kv.stats().indexed < indexed:
        world.events.add("evict")
    if plan.page_copies:
        world.events.add("copy")
    if any(row.request_id in waiting and row.start_position > 0 for row in plan.rows):
        world.events.add("prefix hit")
    if plan.is_empty():
        return
    for update in s.advance(plan, world.executor.run(plan)):
        tokens = world.outputs.setdefault(update.request_id, [])
        tokens += update.new_token_ids
        if update.finished:
            assert s.get(update.request_id) is None, "a finished stream is still live"
            world.events.add(f"natural {update.finish_reason}")
            if reference is not None:  # ended by stop/length: exactly what it produces unpressured
                assert tokens == reference[update.request_id], update.request_id


def reference_outputs(config: SchedulerConfig, specs: list[Spec]) -> dict[str, list[int]]:
    """Each stream's tokens with no memory pressure (same seeds: same submission order)."""
    roomy = copy.copy(config)
    roomy.num_pages = 64
    world = new_world(roomy)
    tokens: dict[str, list[int]] = {}
    for spec in specs:
        world.scheduler.submit(spec.request_id, list(spec.prompt), spec.sampling())
    while world.scheduler.has_unfinished():
        plan = world.scheduler.next_plan()
        for update in world.scheduler.advance(plan, world.executor.run(plan)):
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert world.scheduler.num_preemptions == 0
    return tokens


def check(world: World, reference: dict[str, list[int]]) -> None:
    s = world.scheduler
    s.check_invariants()
    stats = s.kv.stats()
    assert stats.free + stats.referenced + stats.cached_unreferenced == stats.total
    if not s.has_unfinished():
        assert stats.referenced == 0
    for request in s.running() + s.waiting():
        expected = reference[request.request_id]
        assert request.output_token_ids == expected[: len(request.output_token_ids)], request.request_id


def fingerprint(world: World) -> tuple[object, ...]:
    s = world.scheduler
    pool = s.kv.pool
    streams = []
    for request in s.running() + s.waiting():
        state = request.state
        fork_pages = state.fork_pages.pages if isinstance(state, Prefilling) and state.fork_pages else None
        streams.append((
            request.request_id,
            type(state).__name__,
            request.num_computed_tokens,
            tuple(request.output_token_ids),
            tuple(request.table.pages) if request.is_running else (),
            tuple(fork_pages or ()),
            request.pending_copy,
            tuple(request.seeds),
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
    )


def actions(
    world: World, specs: list[Spec], reference: dict[str, list[int]]
) -> list[tuple[str, Callable[[World], None]]]:
    s = world.scheduler
    found: list[tuple[str, Callable[[World], None]]] = [("step", partial(do_step, reference=reference))]
    if world.submitted < len(specs):
        spec = specs[world.submitted]

        def submit(w: World, spec: Spec = spec) -> None:
            w.scheduler.submit(spec.request_id, list(spec.prompt), spec.sampling())
            w.submitted += 1

        found.append((f"submit {spec.request_id}", submit))
    live = sorted(r.request_id for r in s.running() + s.waiting())
    for stream_id in live:
        found.append((f"finish {stream_id}", partial(_finish, stream_id=stream_id)))
    for user_id in sorted({r.parent_id for r in s.running() + s.waiting()}):
        found.append((f"abort {user_id}", partial(_abort, user_id=user_id)))
    return found


def _finish(world: World, stream_id: str) -> None:
    assert world.scheduler.finish(stream_id, "stop", "STOP")


def _abort(world: World, user_id: str) -> None:
    assert world.scheduler.abort(user_id)


def explore(config: SchedulerConfig, specs: list[Spec], liveness_bound: int) -> tuple[int, set[str]]:
    coverage: set[str] = set()
    reference = reference_outputs(config, specs)
    root = new_world(config)
    seen: dict[tuple[object, ...], tuple[object, ...] | None] = {}  # state -> its step successor
    done: set[tuple[object, ...]] = set()
    stack: list[tuple[World, tuple[object, ...], tuple[str, ...]]] = [(root, fingerprint(root), ())]
    seen[fingerprint(root)] = None
    while stack:
        world, key, path = stack.pop()
        if not world.scheduler.has_unfinished():
            done.add(key)
        for name, act in actions(world, specs, reference):
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
    Spec("b", (1, 2, 3, 4, 5), n=2, max_tokens=2),
    Spec("c", (1, 2), max_tokens=2, stop=(0,)),
    Spec("d", (1, 2, 3, 4), max_tokens=2),
]
EXERCISED = {"copy", "evict", "natural length", "natural stop", "preempt", "prefix hit"}


def test_every_interleaving_keeps_books_and_finishes() -> None:
    states, coverage = explore(config(num_pages=5), SPECS, liveness_bound=60)
    assert states > 1000 and coverage == EXERCISED  # the search really branched into every mechanism


def test_every_interleaving_on_the_smallest_pool_without_caching() -> None:
    specs = [Spec("a", (1, 2, 3), max_tokens=4), Spec("b", (1, 2, 3, 4, 5), n=2, max_tokens=3), SPECS[2]]
    states, coverage = explore(config(num_pages=4, caching=False), specs, liveness_bound=60)
    assert states > 100 and {"copy", "preempt"} <= coverage and "prefix hit" not in coverage


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
            sampling = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[0])  # type: ignore[arg-type]
            fork_pages = -(-len(prompt) // 2) + (n - 1) * (len(prompt) % 2)  # type: ignore[arg-type, operator]
            if fork_pages > num_pages:
                with pytest.raises(ContextTooLong):
                    s.submit(rid, list(prompt), sampling)  # type: ignore[call-overload]
                continue
            s.submit(rid, list(prompt), sampling)  # type: ignore[call-overload]
            submitted.append(rid)
        elif kind == "step":
            do_step(world)
        elif submitted:
            target = submitted[op[1] % len(submitted)]  # type: ignore[operator]
            live = [r.request_id for r in s.running() + s.waiting() if r.parent_id == target]
            if kind == "abort":
                assert s.abort(target) == bool(live)
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
