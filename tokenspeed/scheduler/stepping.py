"""Applying one executed row to its request: progress, samples, stop checks.

Kept apart from the scheduler's queue policy because it is pure per-request
bookkeeping: it never chooses who runs, it only records what ran. The caller
(the scheduler) finishes requests whose update says `finished` (that frees
their pages at once). No allocation happens here, so advancing cannot fail.

Stop rule (vLLM-compatible): a sampled token in `sampling.stop_ids()` ends the
stream once `min_tokens` are out (`"stop"`, `stop_reason` = the token);
otherwise reaching the effective max output ends it (`"length"`).

A verify row (speculative decoding) emits 1 .. k+1 tokens: they are appended
one by one under the same rule, and the first that ends the stream drops the
rest. The tokens computed are then the row's input and the drafts accepted
before the last appended token (the last one is uncomputed, as after any
decode), and the pages past them, which held only rejected drafts, are freed
(`BlockTable.truncate`); the executor learns it from the request's next row
(`num_pages_sent` falls back). Pages are only indexed up to computed tokens,
so no page holding a rejected draft is ever published.
"""

from __future__ import annotations

from tokenspeed.kvcache import KVCache
from tokenspeed.scheduler.fsm import ChunkDone, PrefillDone, Prefilling
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID, RowOutput, ScheduledRow, TokenLogprob
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.updates import RequestUpdate


def publish(request: Request, kv: KVCache, upto: int | None = None) -> None:
    """Index the request's full pages of positions `< upto` (default: its computed tokens).

    The scheduler passes a row's end when it schedules the row (see `rows.make_row`):
    the pages are computed by that step, before any later step runs. A placeholder
    sample is never indexed: it is never computed, and a scheduled row stops short of it.
    """
    outputs = request.output_token_ids
    at_placeholder = bool(outputs) and outputs[-1] == PLACEHOLDER_TOKEN_ID
    if upto is None:
        upto = request.num_computed_tokens
        if at_placeholder and upto == request.num_tokens:
            raise AssertionError(f"{request.request_id}: a placeholder sample counts as computed")
    elif at_placeholder and upto == request.num_tokens:
        upto -= 1
    if not kv.enable_prefix_caching:
        return
    table = request.table
    if upto // kv.page_size > table.num_published:
        kv.publish(table, request.all_token_ids, upto)


def stop_check(request: Request, token: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if `token`, just appended, ends the stream."""
    num_output = len(request.output_token_ids)
    if token in request.stop_token_ids and num_output >= request.sampling.min_tokens:
        return "stop", token
    if num_output >= request.max_output_tokens:
        return "length", None
    return None


def advance_row(request: Request, row: ScheduledRow, output: RowOutput, kv: KVCache) -> RequestUpdate | None:
    """Record that `row` ran for `request`; its update (None: a prompt chunk with nothing to report)."""
    if row.start_position != request.num_computed_tokens:
        raise AssertionError(
            f"row of {request.request_id} starts at {row.start_position}, "
            f"but {request.num_computed_tokens} tokens are computed"
        )
    _check_samples(row, output)
    prompt_logprobs = None
    if row.prompt_logprobs_start is not None:
        request.prompt_logprobs_next = min(row.end_position, request.num_prompt_tokens - 1)
        prompt_logprobs = output.prompt_logprobs
    if not row.sample:
        _computed(request, row.end_position, row, kv)
        request.apply(ChunkDone())
        return _update(request, [], None, prompt_logprobs) if prompt_logprobs else None

    if isinstance(request.state, Prefilling):
        request.apply(PrefillDone())
    sampled = output.sampled_token_ids
    outputs = request.output_token_ids
    stop = None
    if len(outputs) + len(sampled) < request.max_output_tokens and request.stop_token_ids.isdisjoint(sampled):
        emitted = list(sampled)  # no token can stop the stream (`stop_check`): a verify row's tokens at once
        outputs.extend(emitted)
    else:
        emitted = []
        for token in sampled:
            outputs.append(token)
            emitted.append(token)
            stop = stop_check(request, token)
            if stop is not None:
                break
    # The input and the accepted drafts before the last emitted token are computed.
    _computed(request, row.end_position + len(emitted) - 1, row, kv)
    logprobs = None if output.logprobs is None else output.logprobs[: len(emitted)]
    update = _update(request, emitted, logprobs, prompt_logprobs)
    if stop is not None:
        update.finished = True
        update.finish_reason, update.stop_reason = stop
    return update


def _check_samples(row: ScheduledRow, output: RowOutput) -> None:
    sampled = output.sampled_token_ids
    if not row.num_draft_tokens:
        if len(sampled) != row.num_samples:
            raise ValueError(f"row {row.request_id!r} asked for {row.num_samples} samples, got {len(sampled)}")
        return
    if not 1 <= len(sampled) <= row.max_samples:
        raise ValueError(
            f"verify row {row.request_id!r} drafted {row.num_draft_tokens} tokens: it emits 1 to "
            f"{row.max_samples}, got {len(sampled)}"
        )
    if row.draft_token_ids and sampled[:-1] != row.draft_token_ids[: len(sampled) - 1]:
        raise ValueError(f"verify row {row.request_id!r} emitted {sampled}, which does not start with "
                         f"its accepted drafts {row.draft_token_ids}")


def _computed(request: Request, computed: int, row: ScheduledRow, kv: KVCache) -> None:
    """Record `computed` tokens as computed: roll back pages beyond them, index newly full pages."""
    request.num_computed_tokens = computed
    if row.num_draft_tokens:
        keep = kv.pages_for(computed)
        if keep < len(request.table):
            request.table.truncate(keep)
            request.num_pages_sent = min(request.num_pages_sent, keep)
    if computed // kv.page_size > row.start_position // kv.page_size:  # the row filled a page
        publish(request, kv)


def _update(
    request: Request,
    tokens: list[int],
    logprobs: list[TokenLogprob] | None,
    prompt_logprobs: list[TokenLogprob] | None,
) -> RequestUpdate:
    return RequestUpdate(
        request_id=request.request_id,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        new_prompt_logprobs=prompt_logprobs,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(0, request.num_cached_tokens),
        queue_time_s=request.queue_time_s if tokens and len(request.output_token_ids) == len(tokens) else None,
    )
