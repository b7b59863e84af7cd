"""Model checking speculative decoding: every interleaving, with drafts partially accepted.

The search of `test_model_checker.py` (and its overlap moves from
`test_overlap_model_checker.py`) explores a scheduler that drafts: decode rows
carry k drafts, from a host drafter that guesses the hash model's greedy token
(right for greedy streams unless a hash of the history says otherwise, a
coin toss for sampled ones) or from the simulated executor's own device
drafter. The executor verifies them like a real verifier, checks that every
row's pages hold its history and drafts, and that the pages of rejected drafts
are given back (the next row cuts the table to exactly the accepted
positions). After every action it proves what the plain search proves: books
balance, no handle leaked or freed twice, `len(table) == pages for computed
tokens` between steps (no page kept for a rejected draft), streamed tokens are
a prefix of the non-speculative run's (exactly it, with the same finish
reason, once a stream ends by stop/length), and stepping alone finishes every
request. Steps with drafts run synchronously, as the engine runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from hashlib import blake2b

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_model_checker import (
    Actions,
    Reference,
    Spec,
    World,
    check,
    explore,
    plan_step,
    record,
    user_actions,
)
from tests.test_overlap_model_checker import OverlapWorld, resolve
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor
from tokenspeed.scheduler.speculation import DraftPolicy

VOCAB = 4


@dataclass
class GuessingDrafter:
    """Drafts the hash model's greedy tokens, one off where a hash of the history says so."""

    executor: SimulatedExecutor

    @property
    def method(self) -> str:
        return "guess"

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        history = [*prompt, *output]
        drafts: list[int] = []
        for _ in range(max_tokens):
            token = self.executor.model_token([*history, *drafts], greedy=True)
            if blake2b(repr([*history, *drafts]).encode(), digest_size=1).digest()[0] % 3 == 0:
                token = (token + 1) % VOCAB
            drafts.append(token)
        return drafts

    def release(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        pass


@dataclass
class SpecWorld(OverlapWorld):
    def extra_key(self) -> tuple[object, ...]:
        states = tuple(
            (r.request_id, None if r.draft_state is None else (r.draft_state.accepted, r.draft_state.verified,
                                                                r.draft_state.idle_steps))
            for r in self.scheduler.running() + self.scheduler.waiting()
        )
        return (*super().extra_key(), states)


def spec_config(num_pages: int, *, on_device: bool, k: int = 2, adaptive: bool = False, budget: int = 4,
                caching: bool = True) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=10, page_size=2, num_pages=num_pages,
        enable_prefix_caching=caching,
        speculation=DraftPolicy("guess", k, on_device=on_device, adaptive=adaptive, probe_interval=2),
    )


def new_spec_world(cfg: SchedulerConfig) -> World:
    executor = SimulatedExecutor(cfg.num_pages, cfg.page_size, VOCAB)
    assert cfg.speculation is not None
    drafter = None if cfg.speculation.on_device else GuessingDrafter(executor)
    scheduler = Scheduler(cfg, drafter)
    executor.check_against(scheduler.token_history)
    return SpecWorld(scheduler, executor)


def _spec(world: World) -> SpecWorld:
    assert isinstance(world, SpecWorld)
    return world


def spec_step(world: World, reference: Reference | None = None, overlap: bool = False) -> None:
    """One engine step: overlapped unless the plan verifies drafts (then synchronous, as the engine runs it)."""
    w = _spec(world)
    s = w.scheduler
    plan = plan_step(w)
    if plan.is_empty():
        resolve(w, reference)
        return
    previous = w.pending
    result = w.executor.run(plan, previous)
    if overlap and not plan.has_drafts:
        resolve(w, reference)
        s.advance_provisional(plan)
        w.pending = result
        return
    resolve(w, reference)
    tables = {r.request_id: len(r.table) for r in s.running()}
    record(w, s.advance(plan, result), reference)
    for row, out in zip(plan.rows, result.rows):
        if row.num_draft_tokens:
            accepted = len(out.sampled_token_ids) - 1
            w.events.add("all drafts accepted" if accepted == row.num_draft_tokens else "draft rejected")
            request = s.get(row.request_id)
            if request is not None and request.is_running and len(request.table) < tables[row.request_id]:
                w.events.add("rollback")


def spec_actions(world: World, specs: list[Spec], reference: Reference, overlap: bool = False) -> Actions:
    found: Actions = [("step", partial(spec_step, reference=reference, overlap=overlap))]
    if overlap and _spec(world).pending is not None:
        found.append(("resolve", partial(resolve, reference=reference)))
    return found + user_actions(world, specs)


@dataclass(frozen=True)
class GreedySpec(Spec):
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, stop_token_ids=list(self.stop))


SPECS = [
    GreedySpec("a", (1, 2, 3), max_tokens=6),
    Spec("b", (1, 2), max_tokens=5),
    GreedySpec("c", (2, 3), max_tokens=6, stop=(0,)),  # greedy tokens 2 1 1 0: a stop after drafting
]
EXERCISED = {"all drafts accepted", "draft rejected", "rollback", "natural length", "natural stop", "preempt",
             "prefix hit"}


def test_every_interleaving_with_host_drafts() -> None:
    states, coverage = explore(spec_config(5, on_device=False), SPECS, 60, spec_actions, new_spec_world)
    assert states > 400 and coverage >= EXERCISED


def test_every_interleaving_with_device_drafts_and_overlap() -> None:
    moves = partial(spec_actions, overlap=True)
    states, coverage = explore(spec_config(5, on_device=True), SPECS, 80, moves, new_spec_world)
    assert states > 1000 and coverage >= EXERCISED


def test_every_interleaving_with_host_drafts_overlap_and_no_caching() -> None:
    moves = partial(spec_actions, overlap=True)
    states, coverage = explore(spec_config(5, on_device=False, caching=False), SPECS, 80, moves, new_spec_world)
    assert states > 2000 and coverage >= EXERCISED - {"evict", "prefix hit"}


def test_adaptive_lengths_in_every_interleaving() -> None:
    cfg = spec_config(5, on_device=False, k=3, adaptive=True)
    states, coverage = explore(cfg, SPECS, 60, spec_actions, new_spec_world)
    assert states > 300 and coverage >= EXERCISED


# ---- random operation sequences ----------------------------------------------------------------

submits = st.tuples(st.just("submit"), st.lists(st.integers(0, 3), min_size=1, max_size=9), st.integers(1, 3),
                   st.integers(2, 10), st.booleans())
operations = st.tuples(submits, st.lists(
    st.one_of(
        submits,
        st.tuples(st.sampled_from(["step", "step", "step", "resolve"])),
        st.tuples(st.sampled_from(["abort", "finish"]), st.integers(0, 9)),
    ),
    max_size=40,
)).map(lambda first_and_rest: [first_and_rest[0], *first_and_rest[1]])


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_pages=st.integers(8, 32), budget=st.integers(1, 12), caching=st.booleans(),
       on_device=st.booleans(), overlap=st.booleans(), k=st.integers(1, 4))
def test_random_speculative_sequences(ops: list[tuple[object, ...]], num_pages: int, budget: int, caching: bool,
                                      on_device: bool, overlap: bool, k: int) -> None:
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=16, page_size=2, num_pages=num_pages,
        enable_prefix_caching=caching,
        speculation=DraftPolicy("guess", k, on_device=on_device, adaptive=True, probe_interval=3),
    )
    world = _spec(new_spec_world(cfg))
    s = world.scheduler
    submitted: list[str] = []
    for op in ops:
        kind = op[0]
        if kind == "submit":
            prompt = [1, 2, 3, 1, *op[1]]  # type: ignore[misc]
            n, max_tokens, greedy = op[2], op[3], op[4]
            rid = f"r{len(submitted)}"
            params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max_tokens,  # type: ignore[arg-type]
                                    stop_token_ids=[0])
            for child in range(n):  # type: ignore[call-overload]
                s.submit(f"{rid}#{child}", prompt, params)
            submitted.append(rid)
        elif kind == "step":
            spec_step(world, overlap=overlap)
        elif kind == "resolve":
            resolve(world)
        elif submitted:
            target = submitted[op[1] % len(submitted)]  # type: ignore[operator]
            live = [r.request_id for r in s.running() + s.waiting() if r.request_id.startswith(f"{target}#")]
            if kind == "abort":
                assert all(s.abort(child) for child in live)
            elif live:
                assert s.finish(live[-1], "stop")
        s.check_invariants()
    for _ in range(300):
        if world.settled():
            break
        spec_step(world, overlap=overlap)
        s.check_invariants()
    assert world.settled(), "steps alone did not finish every request"
    stats = s.kv.stats()
    assert stats.referenced == 0 and stats.free + stats.cached_unreferenced == stats.total


def test_check_catches_a_kept_rejected_page() -> None:
    """The search's invariant is not vacuous: a table holding a page past its computed tokens fails it."""
    world = _spec(new_spec_world(spec_config(6, on_device=False)))
    s = world.scheduler
    s.submit("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6))
    spec_step(world)
    request = s.get("a")
    assert request is not None
    s.kv.allocate(request.table, 1)  # what a missing rollback would leave behind
    try:
        check(world, Reference({"a": [0] * 6}))
    except AssertionError as err:
        assert "rejected drafts" in str(err)
    else:
        raise AssertionError("a page past the computed tokens went unnoticed")
