"""Applying one executed row to its request: progress, samples, stop checks, forks.

Kept apart from the scheduler's queue policy because it is pure per-request
bookkeeping: it never chooses who runs, it only records what ran. The caller
(the scheduler) files the forks into its queues and finishes streams whose
update says `finished` (that frees their pages at once).

Stop rule (vLLM-compatible): a sampled token in `sampling.stop_ids()` ends the
stream once `min_tokens` are out (`"stop"`, `stop_reason` = the token);
otherwise reaching the effective max output ends it (`"length"`).

Forking (`n > 1`): the last prompt chunk samples n tokens. Stream 0 is the
request itself; stream i > 0 is a new Decoding request sharing every full
prompt page (refcount + 1) and, if the last prompt page is partial, owning a
fresh page reserved when the chunk was scheduled, filled by a page copy the
next plan carries. No allocation happens here, so advancing cannot fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.kvcache import KVCache
from tokenspeed.scheduler.fsm import ChunkDone, Decoding, PrefillDone, Prefilling
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID, RowOutput, ScheduledRow, TokenLogprob
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.updates import RequestUpdate


def fork_ids(parent_id: str, n: int) -> list[str]:
    """Stream ids of forks 1 .. n-1 of a user request."""
    return [f"{parent_id}#{i}" for i in range(1, n)]


@dataclass(slots=True)
class RowOutcome:
    forks: list[Request] = field(default_factory=list)  # new streams to file as running
    streams: list[tuple[Request, RequestUpdate]] = field(default_factory=list)


def publish(request: Request, kv: KVCache) -> None:
    """Index the request's newly full, computed pages (never a placeholder: it is never computed)."""
    if request.num_computed_tokens == request.num_tokens and request.output_token_ids[-1:] == [PLACEHOLDER_TOKEN_ID]:
        raise AssertionError(f"{request.request_id}: a placeholder sample counts as computed")
    table = request.table
    if kv.enable_prefix_caching and request.num_computed_tokens // kv.page_size > table.num_published:
        kv.publish(table, request.all_token_ids, request.num_computed_tokens)


def stop_check(request: Request, token: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if `token`, just appended, ends the stream."""
    num_output = len(request.output_token_ids)
    if token in request.stop_token_ids and num_output >= request.sampling.min_tokens:
        return "stop", token
    if num_output >= request.max_output_tokens:
        return "length", None
    return None


def fork(request: Request, kv: KVCache) -> list[Request]:
    """Split an n > 1 request whose prompt just finished into n streams (itself first)."""
    state = request.state
    assert isinstance(state, Prefilling), "only a request finishing its prefill forks"
    num_prompt = request.num_prompt_tokens
    full_pages = num_prompt // kv.page_size
    partial = num_prompt % kv.page_size != 0
    streams = [request]
    for i in range(1, request.num_streams):
        table = state.table.share(full_pages)
        copy: tuple[int, int] | None = None
        if partial:
            assert state.fork_pages is not None, "fork pages were not reserved"
            (fresh,) = table.take_from(state.fork_pages, 1)
            copy = (state.table.page_at(full_pages), fresh)
        streams.append(
            Request(
                request_id=f"{request.parent_id}#{i}",
                parent_id=request.parent_id,
                index=i,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                arrival=request.arrival,
                seeds=[request.seeds[i]],
                max_output_tokens=request.max_output_tokens,
                stop_token_ids=request.stop_token_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs_next=request.prompt_logprobs_next,
                pending_copy=copy,
                state=Decoding(table),
            )
        )
    request.seeds = request.seeds[:1]
    return streams


def advance_row(request: Request, row: ScheduledRow, output: RowOutput, kv: KVCache) -> RowOutcome:
    """Record that `row` ran for `request`; returns the forks made and one update per stream."""
    if row.start_position != request.num_computed_tokens:
        raise AssertionError(
            f"row of {request.request_id} starts at {row.start_position}, "
            f"but {request.num_computed_tokens} tokens are computed"
        )
    if len(output.sampled_token_ids) != row.num_samples:
        raise ValueError(
            f"row {row.request_id!r} asked for {row.num_samples} samples, got {len(output.sampled_token_ids)}"
        )
    request.num_computed_tokens = row.end_position
    prompt_logprobs = None
    if row.prompt_logprobs_start is not None:
        request.prompt_logprobs_next = min(row.end_position, request.num_prompt_tokens - 1)
        prompt_logprobs = output.prompt_logprobs
    publish(request, kv)
    outcome = RowOutcome()
    if not row.sample:
        request.apply(ChunkDone())
        if prompt_logprobs:
            outcome.streams.append((request, _update(request, None, None, prompt_logprobs)))
        return outcome

    streams = [request]
    if request.num_streams > 1:
        streams = fork(request, kv)
        outcome.forks = streams[1:]
    if isinstance(request.state, Prefilling):
        for leftover in request.apply(PrefillDone()):
            leftover.release()
    for i, stream in enumerate(streams):
        token = output.sampled_token_ids[i]
        stream.output_token_ids.append(token)
        logprobs = None if output.logprobs is None else [output.logprobs[i]]
        update = _update(stream, token, logprobs, prompt_logprobs if i == 0 else None)
        stop = stop_check(stream, token)
        if stop is not None:
            update.finished = True
            update.finish_reason, update.stop_reason = stop
        outcome.streams.append((stream, update))
    return outcome


def _update(
    request: Request,
    token: int | None,
    logprobs: list[TokenLogprob] | None,
    prompt_logprobs: list[TokenLogprob] | None,
) -> RequestUpdate:
    return RequestUpdate(
        request_id=request.request_id,
        parent_id=request.parent_id,
        index=request.index,
        new_token_ids=[] if token is None else [token],
        new_logprobs=logprobs,
        new_prompt_logprobs=prompt_logprobs,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(0, request.num_cached_tokens),
    )
