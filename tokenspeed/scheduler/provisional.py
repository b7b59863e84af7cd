"""Overlap scheduling inside the scheduler: advance on placeholder samples, resolve them later.

With overlap the engine launches step N, then must plan step N+1 before step
N's sampled ids reach the host. `Scheduler.advance_provisional(plan)` records
step N with `PLACEHOLDER_TOKEN_ID` as every sample, so `next_plan()` can run at
once (a decode row whose input is the placeholder is filled in by the executor
from step N's output, on the device). `Scheduler.resolve(result)` then writes
the real ids over the placeholders and applies the rules a placeholder could
not decide. Both live here, in the torch-free scheduler, so the model checker
explores them like any other action.

Why this is exact (identical tokens to the synchronous loop):
- length limits depend on counts, not ids, so the provisional advance already
  finishes a stream that reached `max_tokens` (and frees its pages at once);
- a stop token is only seen at `resolve`: the stream is finished then, and
  the one extra step it may have been planned into is dropped (the scheduler
  skips rows of streams that are no longer running). A stream that ended by
  length on a token that is also a stop token reports `"stop"`, as the
  synchronous stop check, which tests stop first, would;
- a placeholder is always the one uncomputed token of its stream until it is
  resolved, and step N must be resolved before step N+1 is advanced (both
  advances refuse otherwise): prefix
  hashing covers computed tokens only, and admission never matches the last
  token, so no placeholder is ever hashed, copied or recomputed (a stream
  preempted with a placeholder is not readmitted in the plan that preempted it).
- updates of step N are reported by `resolve`, one step after the launch;
  an update of a stream aborted or finished by the front end in between is
  dropped, as the synchronous loop would never have produced it.

Rows that return logprobs or prompt logprobs cannot be advanced provisionally
(their payload is the result itself); the engine runs such steps synchronously.

Speculative decoding follows the simplest correct rule: verify rows are never
advanced provisionally either (how many tokens a row emits, and so its
positions, pages and the next row's input, is only known from the result),
so a plan with drafts (`ExecutionPlan.has_drafts`) runs synchronously: the
engine resolves the step in flight, runs the plan and `advance`s it with its
result. A host drafter needs the real last token, so the scheduler gives no
host drafts to a row whose last token is still a placeholder; with a host
drafter the engine must therefore resolve the step in flight before planning
(else, once a step is overlapped, every later plan is built on placeholders
and nothing is drafted again). A device drafter reads the placeholder's
token on the device like the decode input, so its rows may follow an
overlapped step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID, ExecutionPlan, ExecutionResult, RowOutput
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.updates import RequestUpdate


@dataclass(slots=True)
class PendingDraw:
    """One placeholder sample: where its real id comes from and where it goes."""

    row: int  # plan row
    stream: Request
    position: int  # index of the placeholder in stream.output_token_ids
    update: RequestUpdate


@dataclass(slots=True)
class UnresolvedStep:
    """A provisionally advanced step: its placeholders and the updates it will report."""

    step_id: int
    num_rows: int
    draws: list[PendingDraw] = field(default_factory=list)
    updates: list[RequestUpdate] = field(default_factory=list)


def placeholder_result(plan: ExecutionPlan) -> ExecutionResult:
    """The result `advance` is fed in place of the real one: every sample a placeholder."""
    for row in plan.rows:
        if row.prompt_logprobs_start is not None or (row.sample and row.sampling.logprobs is not None):
            raise ValueError(
                f"row {row.request_id!r} returns logprobs: advance it with its result, not provisionally"
            )
        if row.num_draft_tokens:
            raise ValueError(
                f"row {row.request_id!r} verifies drafts: advance it with its result, not provisionally"
            )
    return ExecutionResult(
        step_id=plan.step_id,
        rows=[RowOutput(r.request_id, [PLACEHOLDER_TOKEN_ID] * r.num_samples) for r in plan.rows],
    )


def unresolved_step(plan: ExecutionPlan, applied: list[tuple[int, Request, RequestUpdate]]) -> UnresolvedStep:
    """Remember, from `advance`'s (row, request, update) records, where each placeholder went."""
    step = UnresolvedStep(plan.step_id, len(plan.rows))
    for row, stream, update in applied:
        if update.new_token_ids:
            step.draws.append(PendingDraw(row, stream, len(stream.output_token_ids) - 1, update))
        step.updates.append(update)
    return step


@dataclass(slots=True)
class Resolved:
    updates: list[RequestUpdate]  # the step's updates, real ids in
    stops: list[tuple[Request, int]]  # live streams the real ids stop: the caller finishes them


def resolve_step(step: UnresolvedStep, result: ExecutionResult, is_live: Callable[[Request], bool]) -> Resolved:
    """Patch every placeholder of `step` with `result`'s ids and judge them by the stop-token rule."""
    if result.step_id != step.step_id or len(result.rows) != step.num_rows:
        raise ValueError(
            f"result of step {result.step_id} with {len(result.rows)} rows does not resolve "
            f"step {step.step_id} with {step.num_rows} rows"
        )
    dropped: set[int] = set()
    stops: list[tuple[Request, int]] = []
    for draw in step.draws:
        (token,) = result.rows[draw.row].sampled_token_ids
        _patch(draw, token)
        stream, update = draw.stream, draw.update
        live = is_live(stream)
        if not live and not update.finished:
            dropped.add(id(update))  # aborted or finished by the front end after the launch
        elif token in stream.stop_token_ids and draw.position + 1 >= stream.sampling.min_tokens:
            # The synchronous stop check (stop before length). A stream the placeholder already
            # ended by length keeps its pages freed; only its report changes.
            update.finished, update.finish_reason, update.stop_reason = True, "stop", token
            if live:
                stops.append((stream, token))
    return Resolved([u for u in step.updates if id(u) not in dropped], stops)


def _patch(draw: PendingDraw, token: int) -> None:
    """Write the real id over the placeholder, in the stream's history and its update."""
    outputs = draw.stream.output_token_ids
    if outputs[draw.position] != PLACEHOLDER_TOKEN_ID:
        raise AssertionError(f"{draw.stream.request_id}: output {draw.position} is not a placeholder")
    outputs[draw.position] = token
    draw.update.new_token_ids = [token]
