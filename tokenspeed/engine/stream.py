"""What `AsyncEngine` hands the API layer: per-step output deltas and engine stats.

A server streams text as it is produced, so it wants only what is new since
the last event, not the whole output again (which would make a long stream
quadratic). `RequestDelta` is that increment for one request; when the reader
falls behind, pending deltas are merged (`merge_deltas`) rather than queued,
so a slow client costs one record, not one per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspeed.engine.outputs import PositionLogprobs


@dataclass(slots=True)
class StreamDelta:
    index: int  # which of the n samples
    text: str  # new text since the previous delta of this stream
    token_ids: list[int]  # new token ids
    logprobs: list[PositionLogprobs] | None  # one per new token, when requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the stream's last delta
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    deltas: list[StreamDelta]  # streams that changed in this step
    prompt_token_ids: list[int]
    num_cached_tokens: int
    prompt_logprobs: list[PositionLogprobs | None] | None  # on the first delta that has them
    finished: bool  # all n streams finished
    queue_time_s: float | None = None  # submit to first admission in the scheduler, on one delta only


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    kv_pages_referenced: int = 0
    kv_pages_cached: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    # Speculative decoding (`SpeculationStats`), empty method when off.
    spec_method: str = ""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # KV tiers: requests retracted to the host now, and `kvcache.TierStats` as plain dicts (books of the
    # device / host / disk tiers, counters of copies and hits) plus "page_size"; empty when off.
    num_retracted: int = 0
    kv_tiers: dict[str, Any] = field(default_factory=dict)


def merge_deltas(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """One delta equivalent to `earlier` followed by `later` (of the same request); mutates `earlier`."""
    by_index = {d.index: d for d in earlier.deltas}
    for new in later.deltas:
        old = by_index.get(new.index)
        if old is None:
            earlier.deltas.append(new)
            by_index[new.index] = new
            continue
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + new.logprobs
        if new.finish_reason is not None:
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    earlier.deltas.sort(key=lambda d: d.index)
    earlier.num_cached_tokens = max(earlier.num_cached_tokens, later.num_cached_tokens)
    if earlier.prompt_logprobs is None:
        earlier.prompt_logprobs = later.prompt_logprobs
    if earlier.queue_time_s is None:
        earlier.queue_time_s = later.queue_time_s
    earlier.finished = earlier.finished or later.finished
    return earlier
