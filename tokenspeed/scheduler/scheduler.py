"""`Scheduler`: decides each step's work and owns every request's KV pages.

One step (`next_plan`) is built in a fixed order that protects latency first:

1. running Decoding streams, oldest first, one token each (the per-user
   tokens/s floor never waits behind a long prompt);
2. with speculative decoding, drafts for those decode rows, oldest first,
   from what the budget has left (`speculation.py`);
3. running Prefilling requests, oldest first, chunk = what the token budget
   has left (chunked prefill);
4. Waiting requests, FIFO by original arrival (so a preempted request goes
   back to the front), while requests < max_num_seqs and budget remains;
   each first reuses cached full pages of its prefix. A request that is not
   `ready` (its grammar still compiles) is passed over, not waited for.

A row's full pages are indexed in the prefix cache when the row is scheduled,
not when its results come back: every layer stores the K/V of the whole step
before any row attends (`ExecutionPlan`), so a request admitted later in the
same step can already read them. That is how the n children of an `n > 1`
request (fanned out by the front end, `engine/fan_out.py`) compute the shared
prompt once even when they are admitted together.

When a running request cannot get a page, the newest running request not yet
scheduled this step is preempted (pages published to the prefix index, then
released), possibly the request itself: the oldest request always makes
progress, so every request finishes. Admission never preempts, and nothing
is admitted in a step that preempted (it would thrash). How a victim comes
back is `preemption_mode`: "recompute" re-queues it as Waiting (its prompt
and outputs are prefilled again, minus prefix-cache hits); "retract" (the
default with a host tier) moves it to Retracted, its private pages copied to
the host (`KVCache.retract`, partial: pages the prefix cache or other
requests hold stay on the device), and admission restores retracted requests
first, oldest first, by copying their pages back (`KVCache.restore`); only
what could not be saved is computed again.

Tier copies (kvcache/copy_ops.py) ride on the plans: each plan carries the
copies emitted while it was built (retractions, restores, host hits, batched
write-back of the next pages to be evicted, disk prefetches for submitted
prompts) and each result confirms the copies that finished. A finishing turn
with a `cache_session` has its pages retained for its TTL (retention.py).

`advance` applies the executor's samples, checks stop conditions, publishes
newly full pages and frees finished requests' pages at once; for verify rows
it also rolls back the pages of rejected drafts. With overlap,
`advance_provisional` + `resolve` split it in two around the device's work
(see `provisional.py`). Admission/preemption mechanics live here; building a
row in `rows.py`, per-row bookkeeping of `advance` in `stepping.py`, drafting
in `speculation.py`, the invariant check in `invariants.py`, to keep each file
to one concern.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenspeed.errors import InvalidRequest
from tokenspeed.kvcache import BlockTable, KVCache
from tokenspeed.scheduler.admission import check_admission
from tokenspeed.scheduler.config import SchedulerConfig
from tokenspeed.scheduler.fsm import (
    Admit,
    Decoding,
    Finish,
    Preempt,
    Prefilling,
    Restore,
    Retract,
    Retracted,
)
from tokenspeed.scheduler.invariants import check_scheduler_invariants
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ScheduledRow
from tokenspeed.scheduler.provisional import UnresolvedStep, placeholder_result, resolve_step, unresolved_step
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.rows import make_row
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.speculation import RowDrafts, Speculation, SpeculationStats
from tokenspeed.scheduler.stepping import advance_row, publish
from tokenspeed.scheduler.tiering import blocked_on_disk, restore_cost
from tokenspeed.scheduler.updates import RequestUpdate

if TYPE_CHECKING:
    from tokenspeed.scheduler.drafter import Drafter

_SEED_RANGE = 2**63


@dataclass(slots=True)
class _Step:
    """The plan under construction."""

    budget: int
    rows: list[ScheduledRow] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # aligned with rows
    scheduled: set[int] = field(default_factory=set)  # id() of requests with a row
    preempted: bool = False
    # A request waits this step for pages that tier copies hold: no new write-back (see `_add_copies`).
    starved: bool = False
    # This step's write-back batch went ahead of the admissions (`_writeback_before_admission`).
    written_back: bool = False

    def reserve(self, request: Request, num_tokens: int) -> None:
        """`request` runs this step with `num_tokens` tokens (its row is added later)."""
        self.scheduled.add(id(request))
        self.budget -= num_tokens

    def add(self, request: Request, row: ScheduledRow) -> None:
        self.rows.append(row)
        self.requests.append(request)


@dataclass(slots=True)
class _Inflight:
    step_id: int
    requests: list[Request]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, drafter: Drafter | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`drafter`: the host drafter of `config.speculation` (n-gram, suffix); None otherwise.
        `clock`: seconds, for session retention's expiries and the requests' queue times (tests drive it)."""
        self.config = config
        self._clock = clock
        if config.speculation is None and drafter is not None:
            raise ValueError("a drafter was given but speculative decoding is off (config.speculation is None)")
        self.speculation = None if config.speculation is None else Speculation(config.speculation, drafter)
        self.kv = KVCache(config.num_pages, config.page_size, config.enable_prefix_caching, tiers=config.kv_tiers,
                          clock=clock)
        self.retract_on_preempt = config.preemption_mode == "retract"
        self.num_preemptions = 0
        self.num_retractions = 0
        self._rng = random.Random(config.seed)
        self._next_arrival = 0
        self._step_id = 0
        self._streams: dict[str, Request] = {}  # live requests by id
        self._waiting: list[Request] = []  # sorted by arrival
        self._running: list[Request] = []  # sorted by arrival
        self._retracted: list[Request] = []  # sorted by arrival; restored before any waiting request
        self._released: list[str] = []  # tables the executor drops with the next non-empty plan
        self._inflight: _Inflight | None = None  # planned, not yet advanced
        self._unresolved: UnresolvedStep | None = None  # advanced on placeholders (overlap)

    # ---- queries ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_retracted(self) -> int:
        return len(self._retracted)

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    def get(self, request_id: str) -> Request | None:
        """The live (unfinished) request with this id, if any."""
        return self._streams.get(request_id)

    def token_history(self, request_id: str) -> tuple[list[int], list[int]] | None:
        """(prompt, outputs so far) of a live request, None if it is not live: what a checking
        executor (`SimulatedExecutor`) compares the KV it reads with, as plans carry no history."""
        request = self._streams.get(request_id)
        return None if request is None else (request.prompt_token_ids, request.output_token_ids)

    def running(self) -> list[Request]:
        return list(self._running)

    def waiting(self) -> list[Request]:
        return list(self._waiting)

    def retracted(self) -> list[Request]:
        return list(self._retracted)

    def may_draft(self) -> bool:
        """Whether the next step may carry drafts (speculation on, and the running requests few enough):
        the engine core resolves the step in flight first only then, so a host drafter sees real tokens."""
        return self.speculation is not None and self.speculation.may_draft(self.num_running, self._running)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        return None if self.speculation is None else self.speculation.stats

    # ---- requests in and out --------------------------------------------------------

    def submit(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *, ready: bool = True
    ) -> None:
        """Queue a request; `ready=False` keeps it waiting until `set_ready` (its grammar is compiling)."""
        cfg = self.config
        check_admission(prompt_token_ids, sampling, cfg.limits)
        if request_id in self._streams:
            raise InvalidRequest(f"Request id {request_id!r} is already in use by a live request.")
        if sampling.n != 1:
            raise InvalidRequest(
                f"n={sampling.n}: the scheduler runs one sample per request; the front end fans n > 1 out "
                "into n requests (tokenspeed.engine.fan_out)."
            )
        num_prompt = len(prompt_token_ids)
        max_output = cfg.max_model_len - num_prompt
        if sampling.max_tokens is not None:
            max_output = min(max_output, sampling.max_tokens)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,  # kept, not copied: callers hand it over
            sampling=sampling,
            arrival=self._next_arrival,
            seed=sampling.seed if sampling.seed is not None else self._rng.randrange(_SEED_RANGE),
            max_output_tokens=max_output,
            stop_token_ids=sampling.stop_ids(),
            ready=ready,
            submitted_at=self._clock(),
        )
        self._next_arrival += 1
        self._streams[request_id] = request
        bisect.insort(self._waiting, request, key=_arrival)
        if self.kv.disk is not None and not request.needs_prompt_logprobs:  # start reading disk hits now
            self.kv.prefetch(prompt_token_ids, (num_prompt - 1) // cfg.page_size)

    def set_ready(self, request_id: str) -> bool:
        """A request submitted with `ready=False` may now be admitted; False if it is not live."""
        request = self._streams.get(request_id)
        if request is None:
            return False
        request.ready = True
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a live request; False if nothing live has that id."""
        request = self._streams.get(request_id)
        if request is None:
            return False
        self.finish_request(request, "abort")
        return True

    def finish(self, request_id: str, reason: str, stop_reason: str | None = None) -> bool:
        """End one request (the engine saw a stop string); False if it is not live."""
        request = self._streams.get(request_id)
        if request is None:
            return False
        self.finish_request(request, reason, stop_reason)
        return True

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Move a live request to Finished, publishing then releasing its pages."""
        if request.is_running:
            publish(request, self.kv)
            self._retain(request)
            self._running.remove(request)
            self._release_executor_table(request)
        elif isinstance(request.state, Retracted):
            self._retracted.remove(request)
        else:
            self._waiting.remove(request)
        self._release(request.apply(Finish(reason, stop_reason)))
        del self._streams[request.request_id]
        if self.speculation is not None:
            self.speculation.release(request)

    # ---- building a step ----------------------------------------------------------------

    def next_plan(self) -> ExecutionPlan:
        if self._inflight is not None:
            raise RuntimeError(
                f"plan {self._inflight.step_id} was not advanced; call advance(plan, result) first"
            )
        self._step_id += 1
        step = _Step(budget=self.config.max_num_batched_tokens)
        decoders: list[Request] = []
        for request in [r for r in self._running if isinstance(r.state, Decoding)]:
            if step.budget == 0:
                break
            if request.is_running and self._reserve(request, 1, step):  # not preempted earlier in this step
                decoders.append(request)
        drafts: dict[int, RowDrafts] = {}
        if self.speculation is not None and decoders:
            drafts, used = self.speculation.plan_drafts(decoders, step.budget, self.kv)
            step.budget -= used
        for request in decoders:
            step.add(request, make_row(request, 1, self.kv, drafts.get(id(request))))
        for request in [r for r in self._running if isinstance(r.state, Prefilling)]:
            if step.budget == 0:
                break
            if request.is_running:
                chunk = min(request.num_uncomputed_tokens, step.budget)
                if self._reserve(request, chunk, step):
                    step.add(request, make_row(request, chunk, self.kv))
        if not step.preempted:
            self._writeback_before_admission(step)
            self._admit(step)
        plan = ExecutionPlan(step_id=self._step_id, rows=step.rows)
        self._add_copies(plan, step)
        if not plan.is_empty():
            plan.released_request_ids, self._released = self._released, []
            self._inflight = _Inflight(plan.step_id, step.requests)
        return plan

    def _reserve(self, request: Request, chunk: int, step: _Step) -> bool:
        """Pages for `request`'s next `chunk` tokens, preempting the newest unscheduled requests if
        needed; False if `request` itself was preempted, or waits a step for pages that tier copies
        still hold (a retraction's drained pages, write-back sources: free once their copies land)."""
        end = request.num_computed_tokens + chunk
        grow = self.kv.pages_for(end) - len(request.table)
        if grow > 0:  # most decode steps need no page
            while not self.kv.can_allocate(grow):
                if self.kv.can_allocate_soon(grow):  # copies in flight hold the pages: wait a step for them
                    step.preempted = True  # and admit nobody into them meanwhile
                    step.starved = True
                    return False
                victim = next(r for r in reversed(self._running) if id(r) not in step.scheduled)
                if self.retract_on_preempt:
                    self._retract(victim)
                else:
                    self._preempt(victim)
                step.preempted = True
                if victim is request:
                    return False
            self.kv.allocate(request.table, grow)
        step.reserve(request, chunk)
        return True

    def _admit(self, step: _Step) -> None:
        if self._retracted and not self._restore(step):
            return
        cfg = self.config
        position = 0  # requests that are not ready are passed over, in place
        while position < len(self._waiting) and step.budget > 0:
            request = self._waiting[position]
            if not request.ready or blocked_on_disk(self.kv, request):
                position += 1
                continue
            if len(self._running) >= cfg.max_num_seqs:
                return
            if cfg.enable_prefix_caching and not request.needs_prompt_logprobs:
                # Never match everything: the last token must run to produce logits.
                table = self.kv.match_prefix(request.all_token_ids, (request.num_tokens - 1) // cfg.page_size)
            else:
                table = self.kv.new_block_table()
            computed = len(table) * cfg.page_size
            chunk = min(request.num_tokens - computed, step.budget)
            grow = self.kv.pages_for(computed + chunk) - len(table)
            if not self.kv.can_allocate(grow):
                step.starved |= self.kv.can_allocate_soon(grow)
                table.release()
                return
            self.kv.allocate(table, grow)
            self._waiting.pop(position)
            request.num_computed_tokens = computed
            if request.num_cached_tokens < 0:  # its first admission
                request.num_cached_tokens = computed
                request.queue_time_s = self._clock() - request.submitted_at
            self._release(request.apply(Admit(table)))
            bisect.insort(self._running, request, key=_arrival)
            step.reserve(request, chunk)
            step.add(request, make_row(request, chunk, self.kv))

    def _restore(self, step: _Step) -> bool:
        """Bring retracted requests back, oldest first; False if admission must stop here (FIFO)."""
        size = self.config.page_size
        for request in list(self._retracted):
            if step.budget == 0 or len(self._running) >= self.config.max_num_seqs:
                return False
            state = request.state
            assert isinstance(state, Retracted)
            retraction = state.retraction
            if not self.kv.is_restorable(retraction):
                continue  # its copies to the host have not landed yet: the others may go
            # Room for its pages and, unless its last page has room, one more for the next token.
            extra = 1 if retraction.num_computed_tokens % size == 0 else 0
            need = restore_cost(self.kv, retraction) + extra
            if not self.kv.can_allocate(need):
                step.starved |= self.kv.can_allocate_soon(need)
                return False
            restored = self.kv.restore(retraction)
            self._retracted.remove(request)
            self._release(request.apply(Restore(restored.table)))
            request.num_computed_tokens = restored.num_computed_tokens
            table = request.table
            room = (len(table) + self.kv.pool.num_allocatable) * size - restored.num_computed_tokens
            chunk = min(request.num_uncomputed_tokens, step.budget, room)
            assert chunk >= 1, "restore_cost under-counted the pages a restore takes"
            self.kv.allocate(table, self.kv.pages_for(request.num_computed_tokens + chunk) - len(table))
            bisect.insort(self._running, request, key=_arrival)
            step.reserve(request, chunk)
            step.add(request, make_row(request, chunk, self.kv))
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute later: publish what is computed (so it can be matched back), free the pages."""
        publish(request, self.kv)
        self._release(request.apply(Preempt()))
        self._release_executor_table(request)
        request.num_computed_tokens = 0
        self._running.remove(request)
        bisect.insort(self._waiting, request, key=_arrival)
        self.num_preemptions += 1

    def _retract(self, request: Request) -> None:
        """Resume later from the host: publish what is computed, save the private pages, free the rest."""
        publish(request, self.kv)
        computed = request.num_computed_tokens
        self._release(request.apply(Retract(lambda table: self.kv.retract(table, computed))))
        if self.config.writeback_pages_per_step:  # its published pages, now evictable: to the host before they go
            self.kv.writeback(self.config.writeback_pages_per_step)
        self._release_executor_table(request)
        request.num_computed_tokens = 0
        self._running.remove(request)
        bisect.insort(self._retracted, request, key=_arrival)
        self.num_preemptions += 1
        self.num_retractions += 1

    def _retain(self, request: Request) -> None:
        """A finishing turn of a session: keep its indexed pages warm for the session's TTL (soft)."""
        session = request.sampling.cache_session
        if session is not None and self.kv.enable_prefix_caching:
            self.kv.retain(request.table, session, request.sampling.cache_ttl)

    def _writeback_before_admission(self, step: _Step) -> None:
        """The step's write-back batch ahead of the admissions, when requests wait (their pages evict others).

        The batch in `_add_copies` comes after this plan's allocations: a turn that just finished
        left its new pages evictable and not yet on the host, and under a tight pool the next
        admission evicted them at once (drops, re-prefilled on the session's next turn). Copied
        first, they are pinned until their copies land: an admission that needs them waits a step
        instead (`can_allocate_soon`), and write-back converges, so that wait is bounded. One batch a
        step either way: `_add_copies` then writes back to disk only.
        """
        batch = self.config.writeback_pages_per_step
        if self.kv.host is not None and batch and (self._waiting or self._retracted):
            self.kv.writeback(batch)
            step.written_back = True

    def _add_copies(self, plan: ExecutionPlan, step: _Step) -> None:
        """Hand the plan the tier copies emitted while it was built, plus this step's write-back batch.

        No device -> host write-back in a step in which a request waits for pages that copies hold
        (`step.starved`): a write-back source is pinned until its copy is confirmed, and with overlap
        the next plan is built before this one's copies are. With a host tier smaller than the
        device's cached pages, every batch used to evict host slots of pages still cached on the
        device, so the next batch copied those again: some pages were always pinned when the next
        plan was built, and a request needing all but a few of the cached pages (a long prefill
        chunk, a restore) waited for them forever (issue 13). Write-back now converges (it never
        trades a host copy for a less urgent one: `tier_transfers._WritebackSlots`), but under load
        any batch still pins its sources for a step, so the rule stays. Skipping one batch lets the copies in flight
        drain; the pages are allocatable for the next plan built after they land. Write-back resumes
        once nobody waits, so at worst a page evicted meanwhile is a drop (cache, not tokens).
        Host -> disk write-back pins host slots only, so it goes on.
        """
        kv = self.kv
        if kv.host is None:
            return
        batch = self.config.writeback_pages_per_step
        if batch:
            device_batch = 0 if step.starved or step.written_back else batch
            kv.writeback(device_batch, max_disk_pages=batch if kv.disk is not None else 0)
        plan.copies = kv.take_copies()
        # Nothing else to run while copies are in flight (a retraction to land, a disk read): wait for them.
        plan.wait_for_copies = not plan.rows and len(kv.copies) > 0

    def _complete_copies(self, result: ExecutionResult) -> None:
        for op_id, ok in result.completed_copies:
            self.kv.complete(op_id, ok)

    def _release_executor_table(self, request: Request) -> None:
        """The request gave up its pages: the executor drops its copy of the table."""
        if request.num_pages_sent:
            self._released.append(request.request_id)
            request.num_pages_sent = 0

    # ---- applying a step's results --------------------------------------------------------

    def advance(self, plan: ExecutionPlan, result: ExecutionResult) -> list[RequestUpdate]:
        """Record `plan`'s real results: samples, stop checks, pages; the requests' updates."""
        self._require_resolved("advance")
        self._complete_copies(result)
        return [update for _, _, update in self._apply(plan, result)]

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
        self._complete_copies(result)
        resolved = resolve_step(step, result, lambda r: self._streams.get(r.request_id) is r)
        self._unresolved = None
        for stream, token in resolved.stops:
            self.finish_request(stream, "stop", token)
        return resolved.updates

    def _require_resolved(self, caller: str) -> None:
        if self._unresolved is not None:
            raise RuntimeError(f"{caller}: step {self._unresolved.step_id} must be resolved first")

    def _apply(self, plan: ExecutionPlan, result: ExecutionResult) -> list[tuple[int, Request, RequestUpdate]]:
        """Apply a result row by row; (plan row, request, update) per update."""
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
        applied: list[tuple[int, Request, RequestUpdate]] = []
        for i, (row, output, request) in enumerate(zip(plan.rows, result.rows, inflight.requests, strict=True)):
            if output.request_id != row.request_id:
                raise ValueError(f"result row {output.request_id!r} answers plan row {row.request_id!r}")
            if not request.is_running:
                continue  # aborted or finished after the plan was built
            update = advance_row(request, row, output, self.kv)
            if row.num_draft_tokens and self.speculation is not None:
                self.speculation.record(request, row.num_draft_tokens, len(output.sampled_token_ids))
            if update is None:
                continue
            if update.finished:
                assert update.finish_reason is not None
                self.finish_request(request, update.finish_reason, update.stop_reason)
            applied.append((i, request, update))
        return applied

    # ---- checking -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, states and page ownership agree (call between steps)."""
        check_scheduler_invariants(
            self.kv, self._running, self._waiting, self._retracted, self._streams,
            between_steps=self._inflight is None, provisional=self._unresolved is not None,
        )  # fmt: skip

    # ---- helpers ------------------------------------------------------------------------

    def _release(self, tables: list[BlockTable]) -> None:
        for table in tables:
            table.release()


def _arrival(request: Request) -> int:
    return request.arrival
