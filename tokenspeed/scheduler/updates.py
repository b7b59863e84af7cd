"""What the scheduler tells the engine after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.scheduler.plan import TokenLogprob


@dataclass(slots=True)
class RequestUpdate:
    """New tokens (and maybe the end) of one generation stream.

    An `n > 1` request yields one stream per sample: `request_id` is the id the
    scheduler tracks (forks get `f"{parent_id}#{index}"`), `parent_id` the id the
    user submitted, and `index` the sample's position in the user's output list.
    """

    request_id: str
    parent_id: str
    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    new_prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id (str stops are set by the engine)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
