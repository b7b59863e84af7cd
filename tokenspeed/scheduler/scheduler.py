"""`Scheduler`: decides each step's work and owns every request's KV pages.

One step (`next_plan`) is built in a fixed order that protects latency first:

1. running Decoding streams, oldest first, one token each (the per-user
   tokens/s floor never waits behind a long prompt);
2. running Prefilling requests, oldest first, chunk = what the token budget
   has left (chunked prefill);
3. Waiting requests, FIFO by original arrival (so a preempted request goes
   back to the front), while streams < max_num_seqs and budget remains;
   each first reuses cached full pages of its prefix.

When a running request cannot get a page, the newest running request not yet
scheduled this step is preempted (pages published to the prefix index, then
released; recomputed later), possibly the request itself: the oldest request
always makes progress, so every request finishes. Admission never preempts,
and nothing is admitted in a step that preempted (it would thrash).

`advance` applies the executor's samples, checks stop conditions, forks
`n > 1` requests, publishes newly full pages and frees finished requests'
pages at once. With overlap, `advance_provisional` + `resolve` split it in
two around the device's work (see `provisional.py`). Admission/preemption
mechanics live here; per-row bookkeeping of `advance` lives in `stepping.py`
to keep each file to one concern.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from tokenspeed.errors import InvalidRequest
from tokenspeed.kvcache import BlockTable, KVCache
from tokenspeed.scheduler.admission import check_admission
from tokenspeed.scheduler.config import SchedulerConfig
from tokenspeed.scheduler.fsm import Admit, Decoding, Finish, Preempt, Prefilling, ReserveForkPages, Waiting
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID, ExecutionPlan, ExecutionResult, ScheduledRow
from tokenspeed.scheduler.provisional import UnresolvedStep, placeholder_result, resolve_step, unresolved_step
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.stepping import advance_row, fork_ids, publish
from tokenspeed.scheduler.updates import RequestUpdate

_SEED_RANGE = 2**63


@dataclass(slots=True)
class _Step:
    """The plan under construction."""

    budget: int
    rows: list[ScheduledRow] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # aligned with rows
    scheduled: set[int] = field(default_factory=set)  # id() of requests with a row
    preempted: bool = False

    def add(self, request: Request, row: ScheduledRow) -> None:
        self.rows.append(row)
        self.requests.append(request)
        self.scheduled.add(id(request))
        self.budget -= len(row.input_token_ids)


@dataclass(slots=True)
class _Inflight:
    step_id: int
    requests: list[Request]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCache(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.num_preemptions = 0
        self._rng = random.Random(config.seed)
        self._next_arrival = 0
        self._step_id = 0
        self._streams: dict[str, Request] = {}  # live streams by stream id
        # user id -> its stream ids in use (live, or reserved for forks to come)
        self._users: dict[str, set[str]] = {}
        self._owner: dict[str, str] = {}  # stream id in use -> user id
        self._waiting: list[Request] = []  # sorted by order_key
        self._running: list[Request] = []  # sorted by order_key
        self._new_forks: list[Request] = []  # forks whose page copy goes into the next plan
        self._inflight: _Inflight | None = None  # planned, not yet advanced
        self._unresolved: UnresolvedStep | None = None  # advanced on placeholders (overlap)

    # ---- queries ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    def get(self, request_id: str) -> Request | None:
        """The live (unfinished) stream with this id, if any."""
        return self._streams.get(request_id)

    def running(self) -> list[Request]:
        return list(self._running)

    def waiting(self) -> list[Request]:
        return list(self._waiting)

    # ---- requests in and out --------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        cfg = self.config
        check_admission(prompt_token_ids, sampling, cfg.limits)
        if request_id in self._owner or request_id in self._users:
            raise InvalidRequest(f"Request id {request_id!r} is already in use by a live request.")
        num_prompt = len(prompt_token_ids)
        n = sampling.n
        forks = fork_ids(request_id, n)
        if any(f in self._owner or f in self._users for f in forks):
            raise InvalidRequest(f"The stream ids of request {request_id!r} (n={n}) collide with live ones.")
        max_output = cfg.max_model_len - num_prompt
        if sampling.max_tokens is not None:
            max_output = min(max_output, sampling.max_tokens)
        if sampling.seed is not None:
            seeds = [sampling.seed + i for i in range(n)]
        else:
            seeds = [self._rng.randrange(_SEED_RANGE) for _ in range(n)]
        request = Request(
            request_id=request_id,
            parent_id=request_id,
            index=0,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival=self._next_arrival,
            seeds=seeds,
            max_output_tokens=max_output,
            stop_token_ids=sampling.stop_ids(),
        )
        self._next_arrival += 1
        ids = {request_id, *forks}
        self._users[request_id] = ids
        for stream_id in ids:
            self._owner[stream_id] = request_id
        self._streams[request_id] = request
        bisect.insort(self._waiting, request, key=lambda r: r.order_key)

    def abort(self, request_id: str) -> bool:
        """Abort a stream, or every stream of a user id; False if nothing live has that id."""
        if request_id in self._users:
            targets = [self._streams[s] for s in sorted(self._users[request_id]) if s in self._streams]
        elif request_id in self._streams:
            targets = [self._streams[request_id]]
        else:
            return False
        for request in targets:
            self.finish_request(request, "abort")
        return bool(targets)

    def finish(self, request_id: str, reason: str, stop_reason: str | None = None) -> bool:
        """End one stream (the engine saw a stop string); False if it is not live."""
        request = self._streams.get(request_id)
        if request is None:
            return False
        self.finish_request(request, reason, stop_reason)
        return True

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Move a live stream to Finished, publishing then releasing its pages."""
        if request.is_running:
            publish(request, self.kv)
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self._release(request.apply(Finish(reason, stop_reason)))
        request.pending_copy = None
        del self._streams[request.request_id]
        ids = self._users[request.parent_id]
        gone = [request.request_id, *fork_ids(request.parent_id, request.num_streams)]
        for stream_id in gone:
            ids.discard(stream_id)
            self._owner.pop(stream_id, None)
        if not ids:
            del self._users[request.parent_id]

    # ---- building a step ----------------------------------------------------------------

    def next_plan(self) -> ExecutionPlan:
        if self._inflight is not None:
            raise RuntimeError(
                f"plan {self._inflight.step_id} was not advanced; call advance(plan, result) first"
            )
        self._step_id += 1
        step = _Step(budget=self.config.max_num_batched_tokens)
        for request in [r for r in self._running if isinstance(r.state, Decoding)]:
            if step.budget == 0:
                break
            if request.is_running:  # not preempted earlier in this step
                self._schedule_running(request, 1, step)
        for request in [r for r in self._running if isinstance(r.state, Prefilling)]:
            if step.budget == 0:
                break
            if request.is_running:
                self._schedule_running(request, min(request.num_uncomputed_tokens, step.budget), step)
        if not step.preempted:
            self._admit(step)
        copies: list[tuple[int, int]] = []
        for fork in self._new_forks:
            if fork.pending_copy is not None and fork.is_running:
                copies.append(fork.pending_copy)
            fork.pending_copy = None
        self._new_forks.clear()
        plan = ExecutionPlan(step_id=self._step_id, rows=step.rows, page_copies=copies)
        if not plan.is_empty():
            self._inflight = _Inflight(plan.step_id, step.requests)
        return plan

    def _fork_pages_needed(self, request: Request, end: int) -> int:
        """Copy-on-write pages to reserve when a chunk ending at `end` makes an n > 1 request fork."""
        if request.num_streams == 1 or end < request.num_tokens:
            return 0
        if request.num_prompt_tokens % self.config.page_size == 0:
            return 0  # every prompt page is full: the forks share them all
        return request.num_streams - 1

    def _reserve_fork_pages(self, request: Request, count: int) -> None:
        if count:
            pages = self.kv.new_block_table()
            self.kv.allocate(pages, count)
            self._release(request.apply(ReserveForkPages(pages)))

    def _schedule_running(self, request: Request, chunk: int, step: _Step) -> None:
        end = request.num_computed_tokens + chunk
        fork_pages = self._fork_pages_needed(request, end)
        grow = max(0, self.kv.pages_for(end) - len(request.table))
        while not self.kv.can_allocate(grow + fork_pages):
            victim = next(r for r in reversed(self._running) if id(r) not in step.scheduled)
            self._preempt(victim)
            step.preempted = True
            if victim is request:
                return
        self.kv.allocate(request.table, grow)
        self._reserve_fork_pages(request, fork_pages)
        step.add(request, self._make_row(request, chunk))

    def _admit(self, step: _Step) -> None:
        cfg = self.config
        load = sum(r.num_streams for r in self._running)
        while self._waiting and step.budget > 0:
            request = self._waiting[0]
            if load + request.num_streams > cfg.max_num_seqs:
                return
            if cfg.enable_prefix_caching and not request.needs_prompt_logprobs:
                # Never match everything: the last token must run to produce logits.
                table = self.kv.match_prefix(request.all_token_ids, (request.num_tokens - 1) // cfg.page_size)
            else:
                table = self.kv.new_block_table()
            computed = len(table) * cfg.page_size
            chunk = min(request.num_tokens - computed, step.budget)
            fork_pages = self._fork_pages_needed(request, computed + chunk)
            grow = self.kv.pages_for(computed + chunk) - len(table)
            if not self.kv.can_allocate(grow + fork_pages):
                table.release()
                return
            self.kv.allocate(table, grow)
            self._waiting.pop(0)
            request.num_computed_tokens = computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            self._release(request.apply(Admit(table)))
            self._reserve_fork_pages(request, fork_pages)
            bisect.insort(self._running, request, key=lambda r: r.order_key)
            load += request.num_streams
            step.add(request, self._make_row(request, chunk))

    def _make_row(self, request: Request, chunk: int) -> ScheduledRow:
        start = request.num_computed_tokens
        end = start + chunk
        sample = end == request.num_tokens
        logprobs_start: int | None = None
        # Position p carries the logprob of prompt token p + 1, so the last one is P - 2.
        if request.sampling.prompt_logprobs is not None and request.prompt_logprobs_next < min(
            end, request.num_prompt_tokens - 1
        ):
            assert request.prompt_logprobs_next >= start, "prompt logprob positions skipped"
            logprobs_start = request.prompt_logprobs_next
        return ScheduledRow(
            request_id=request.request_id,
            input_token_ids=request.all_token_ids[start:end],
            start_position=start,
            page_ids=request.table.pages,
            sampling=request.sampling,
            sample=sample,
            seeds=list(request.seeds) if sample else request.seeds[:1],
            sample_index=len(request.output_token_ids),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            prompt_logprobs_start=logprobs_start,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute later: publish what is computed (so it can be matched back), free the pages."""
        publish(request, self.kv)
        self._release(request.apply(Preempt()))
        request.num_computed_tokens = 0
        request.pending_copy = None
        self._running.remove(request)
        bisect.insort(self._waiting, request, key=lambda r: r.order_key)
        self.num_preemptions += 1

    # ---- applying a step's results --------------------------------------------------------

    def advance(self, plan: ExecutionPlan, result: ExecutionResult) -> list[RequestUpdate]:
        """Record `plan`'s real results: samples, stop checks, forks, pages; one update per stream."""
        self._require_resolved("advance")
        return [update for _, _, _, update in self._apply(plan, result)]

    def advance_provisional(self, plan: ExecutionPlan) -> None:
        """Record `plan` as run with placeholder samples, so the next plan can be built now.

        Its updates come from `resolve(result)`, which must be called before the
        next step is advanced (see `provisional.py`).
        """
        self._require_resolved("advance_provisional")
        self._unresolved = unresolved_step(plan, self._apply(plan, placeholder_result(plan)))

    def resolve(self, result: ExecutionResult) -> list[RequestUpdate]:
        """Patch the provisional step's placeholders with `result`; apply stop tokens; its updates."""
        step = self._unresolved
        if step is None:
            raise RuntimeError(f"step {result.step_id} was not advanced provisionally")
        resolved = resolve_step(step, result, lambda r: self._streams.get(r.request_id) is r)
        self._unresolved = None
        for stream, token in resolved.stops:
            self.finish_request(stream, "stop", token)
        return resolved.updates

    def _require_resolved(self, caller: str) -> None:
        if self._unresolved is not None:
            raise RuntimeError(f"{caller}: step {self._unresolved.step_id} must be resolved first")

    def _apply(
        self, plan: ExecutionPlan, result: ExecutionResult
    ) -> list[tuple[int, int, Request, RequestUpdate]]:
        """Apply a result row by row; (plan row, sample within row, stream, update) per stream."""
        inflight = self._inflight
        if plan.is_empty() and inflight is None:
            return []
        if inflight is None or inflight.step_id != plan.step_id:
            raise RuntimeError(f"plan {plan.step_id} is not the plan awaiting advance()")
        if result.step_id != plan.step_id or len(result.rows) != len(plan.rows):
            raise ValueError(
                f"result of step {result.step_id} with {len(result.rows)} rows does not answer "
                f"plan {plan.step_id} with {len(plan.rows)} rows"
            )
        self._inflight = None
        applied: list[tuple[int, int, Request, RequestUpdate]] = []
        for i, (row, output, request) in enumerate(zip(plan.rows, result.rows, inflight.requests, strict=True)):
            if output.request_id != row.request_id:
                raise ValueError(f"result row {output.request_id!r} answers plan row {row.request_id!r}")
            if not request.is_running:
                continue  # aborted or finished after the plan was built
            outcome = advance_row(request, row, output, self.kv)
            for fork in outcome.forks:
                self._streams[fork.request_id] = fork
                bisect.insort(self._running, fork, key=lambda r: r.order_key)
                self._new_forks.append(fork)
            for k, (stream, update) in enumerate(outcome.streams):
                if update.finished:
                    assert update.finish_reason is not None
                    self.finish_request(stream, update.finish_reason, update.stop_reason)
                applied.append((i, k, stream, update))
        return applied

    # ---- checking -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, states and page ownership agree (call between steps)."""
        self.kv.check_invariants()
        owned: list[BlockTable] = []
        for request in self._running:
            state = request.state
            assert isinstance(state, (Prefilling, Decoding)), f"{request.request_id} runs in {state}"
            owned.append(state.table)
            if isinstance(state, Prefilling) and state.fork_pages is not None:
                owned.append(state.fork_pages)
            if isinstance(state, Decoding):
                assert request.num_uncomputed_tokens == 1, f"{request.request_id} decodes with more to compute"
            else:
                assert request.num_uncomputed_tokens >= 1, f"{request.request_id} prefills with nothing left"
            assert len(state.table) >= self.kv.pages_for(request.num_computed_tokens), "computed KV has no page"
        for request in self._running + self._waiting:
            outputs = request.output_token_ids
            holes = [i for i, t in enumerate(outputs) if t == PLACEHOLDER_TOKEN_ID]
            assert holes in ([], [len(outputs) - 1]), f"{request.request_id} has placeholders at {holes}"
            assert not holes or self._unresolved is not None, f"{request.request_id} keeps a resolved placeholder"
            assert not holes or request.num_uncomputed_tokens >= 1, f"{request.request_id} computed a placeholder"
        for request in self._waiting:
            assert isinstance(request.state, Waiting), f"{request.request_id} queued in {request.state}"
            assert request.num_computed_tokens == 0, f"waiting {request.request_id} claims computed tokens"
        queued = self._running + self._waiting
        assert len({id(r) for r in queued}) == len(queued) == len(self._streams), "a stream is lost or queued twice"
        assert all(self._streams.get(r.request_id) is r for r in queued), "queues and stream ids disagree"
        for queue in (self._running, self._waiting):
            keys = [r.order_key for r in queue]
            assert keys == sorted(keys), "a queue is out of arrival order"
        holders = {id(t) for t in self.kv.pool.live_holders()}
        assert holders == {id(t) for t in owned}, (
            f"{len(holders)} live BlockTables but running requests own {len(owned)}: a handle leaked"
        )

    # ---- helpers ------------------------------------------------------------------------

    def _release(self, tables: list[BlockTable]) -> None:
        for table in tables:
            table.release()
