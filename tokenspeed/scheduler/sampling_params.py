"""`SamplingParams`: what a request asks of the sampler and the stop logic.

Field names, defaults and meanings follow vLLM's `SamplingParams`, so that
switching engines is a one-line change. Validation happens here, at
construction, so a bad request fails before it reaches the scheduler.
Torch-free: the scheduler reads the stop/length fields directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

GREEDY_EPSILON = 1e-5  # temperature below this means argmax (the sampling kernels read it too)
_MAX_INT32 = 2**31 - 1
# Upper bounds well past any useful setting: beyond them the distribution no longer changes in
# bf16, and a finite bound keeps 1e308 (or a typo) from passing for a meaningful value.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
# OpenAI's bounds on `logit_bias`: at most 300 token ids, each biased by a value in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
MAX_CACHE_TTL = 86400.0  # a day: past any agent's tool call, and a typo cannot pin pages for years


def _check_int(name: str, value: object, low: int, high: int) -> None:
    """An int (a bool is not one) in [low, high]."""
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}.")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    """A finite number in [low, high]: NaN compares false with everything and would slip through `<`."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidRequest(f"{name} must be a finite number in [{low}, {high}], got {value!r}.")


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
    # token id -> bias added to its logit before sampling (OpenAI's `logit_bias`); ids as ints or digit strings.
    logit_bias: dict[int, float] | None = None
    # The grammar the output must follow (vLLM's `structured_outputs`; `guided_decoding` is its older name).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    # Session retention (kvcache/retention.py): when this turn finishes, its KV pages stay protected for
    # `cache_ttl` seconds (None: the engine's --session-ttl) under this key. The API fills them from
    # OpenAI's `prompt_cache_key` / `user` or Anthropic's `cache_control`; None: no retention.
    cache_session: str | None = None
    cache_ttl: float | None = None
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
        self._resolve_structured_outputs()
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        self._validate()

    def _resolve_structured_outputs(self) -> None:
        """Either name of the grammar, as a `StructuredOutputsParams` (a dict of its fields is accepted);
        both names then hold it."""
        new, old = self.structured_outputs, self.guided_decoding
        if new is not None and old is not None and new != old:
            raise InvalidRequest("structured_outputs and guided_decoding are two names of one field: set one.")
        given = new if new is not None else old
        spec = None if given is None else StructuredOutputsParams.coerce(given)
        self.structured_outputs = self.guided_decoding = spec

    def _validate(self) -> None:
        _check_int("n", self.n, 1, _MAX_INT32)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, 0, _MAX_INT32)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequest(f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, _MAX_INT32)
        _check_int("min_tokens", self.min_tokens, 0, _MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, _MAX_INT32)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, _MAX_INT32)
        if self.seed is not None:
            # Sample i draws with seed + i, an int64 on the device.
            _check_int("seed", self.seed, -(2**63), 2**63 - self.n)
        for token_id in self.stop_token_ids or []:
            _check_int("stop_token_ids[]", token_id, 0, 2**63 - 1)
        if any(not isinstance(s, str) or not s for s in self.stop or []):
            raise InvalidRequest("stop strings must be non-empty strings.")
        if self.cache_session is not None and (not isinstance(self.cache_session, str) or not self.cache_session):
            raise InvalidRequest("cache_session must be a non-empty string.")
        if self.cache_ttl is not None:
            _check_float("cache_ttl", self.cache_ttl, 0.0, MAX_CACHE_TTL)

    @property
    def greedy(self) -> bool:
        """Temperature ~0 means argmax; the sampler then ignores top-k/p and seeds."""
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_grammar(self) -> bool:
        return self.structured_outputs is not None

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end generation (once `min_tokens` are out)."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)


def _checked_logit_bias(bias: object) -> dict[int, float] | None:
    """`bias` with integer keys (OpenAI sends token ids as JSON object keys, i.e. strings), or a clear
    `InvalidRequest`. Ids are checked against the vocabulary at admission."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {type(bias).__name__}.")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        _check_int("logit_bias token id", token, 0, _MAX_INT32)
        _check_float(f"logit_bias[{key}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        assert isinstance(token, int) and isinstance(value, int | float)
        out[token] = float(value)
    return out or None
