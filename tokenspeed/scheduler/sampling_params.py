"""`SamplingParams`: what a request asks of the sampler and the stop logic.

Field names, defaults and meanings follow vLLM's `SamplingParams`, so that
switching engines is a one-line change. Validation happens here, at
construction, so a bad request fails before it reaches the scheduler.
Torch-free: the scheduler reads the stop/length fields directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.errors import InvalidRequest

_GREEDY_EPSILON = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # Filled by the engine, never by users: ids that end generation besides stop_token_ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k is None or self.top_k < 0:  # vLLM accepts -1 for "disabled"
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise InvalidRequest(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise InvalidRequest(f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidRequest(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}.")
        if any(not s for s in self.stop or []):
            raise InvalidRequest("stop strings must be non-empty.")

    @property
    def greedy(self) -> bool:
        """Temperature ~0 means argmax; the sampler then ignores top-k/p and seeds."""
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end generation (once `min_tokens` are out)."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)
