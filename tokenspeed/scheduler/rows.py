"""Building the row a request runs in a step: its input tokens, positions and new pages.

Kept apart from the scheduler's queue policy (which decides who runs and how
many tokens) and from `stepping.py` (which records what a row produced): this
only turns a decision into the `ScheduledRow` the executor receives.

A row's full pages are indexed when the row is built, not when its results
come back: every layer stores the step's K/V before any row attends, so a
request admitted later in the same step can already match them. Drafts are
never indexed: they are not computed until accepted.
"""

from __future__ import annotations

from tokenspeed.kvcache import KVCache
from tokenspeed.scheduler.plan import ScheduledRow
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.speculation import RowDrafts
from tokenspeed.scheduler.stepping import publish


def make_row(request: Request, chunk: int, kv: KVCache, drafts: RowDrafts | None = None) -> ScheduledRow:
    """The row computing `request`'s next `chunk` tokens (and verifying `drafts`); indexes the pages it fills."""
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
    size = kv.page_size
    if end // size > start // size:  # the row fills a page (else it has nothing new to index)
        publish(request, kv, upto=end)
    table = request.table
    first_new_page = request.num_pages_sent
    request.num_pages_sent = len(table)
    num_prompt = len(request.prompt_token_ids)
    if start >= num_prompt:  # decoding, or recomputing outputs: a plain slice, no TokenView
        inputs = request.output_token_ids[start - num_prompt : end - num_prompt]
    else:
        inputs = request.all_token_ids[start:end]
    row = ScheduledRow(
        request_id=request.request_id,
        input_token_ids=inputs,
        start_position=start,
        first_new_page=first_new_page,
        new_page_ids=table.pages_from(first_new_page),
        sampling=request.sampling,
        sample=sample,
        seed=request.seed,
        sample_index=len(request.output_token_ids),
        prompt_logprobs_start=logprobs_start,
        num_draft_tokens=0 if drafts is None else drafts.num_draft_tokens,
        draft_token_ids=[] if drafts is None else drafts.draft_token_ids,
    )
    if logprobs_start is not None or (sample and request.sampling.needs_penalties):
        row.prompt_token_ids, row.output_token_ids = request.prompt_token_ids, request.output_token_ids
    return row
