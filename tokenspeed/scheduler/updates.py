"""What the scheduler tells the engine after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.scheduler.plan import TokenLogprob


@dataclass(slots=True)
class RequestUpdate:
    """New tokens (and maybe the end) of one request (one sample: see `engine/fan_out.py` for n > 1)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    new_prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id (str stops are set by the engine)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Seconds from submit to the first admission, on the request's first update with tokens only.
    queue_time_s: float | None = None
