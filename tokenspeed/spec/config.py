"""`SpeculativeConfig`: the `speculative_config` option (vLLM's names), parsed and validated.

    speculative_config={"method": "suffix", "num_speculative_tokens": 8}
    speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    speculative_config={"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": 3}

Accepted as a dict, a JSON string (`--speculative-config JSON`) or a
`SpeculativeConfig`. Every mistake (unknown key or method, wrong type, value
out of range, a key the method does not use, a missing draft model) is an
`InvalidRequest` naming the key, raised before any model is loaded.

Methods: `ngram` and `suffix` draft on the host (`spec/ngram.py`,
`spec/suffix.py`, objects the scheduler calls); `mtp`, `eagle`, `eagle3` and
`draft_model` draft on the device (the executor fills the drafts the plan asks
for). Defaults follow vLLM: n-gram lookup sizes default to 5 (or to each
other when one is given); suffix decoding speculates up to its tree depth
(24) unless `num_speculative_tokens` is given, with spec factor 1.0 and
minimum token probability 0.1; MTP drafts 1 token.

Four keys are ours (vLLM has no equivalent): `adaptive_draft_length`
(default true: per-request draft length from recent acceptance, down to 0;
false always drafts the maximum), `draft_token_cost` (one draft
position's cost relative to a decode row, the adaptive length's price) and
`draft_cuda_graphs` (default true: an EAGLE/MTP drafter's forwards replay
CUDA graphs when the target's do; false runs them eagerly) and
`fast_greedy_verify` (default true: a step whose verify rows are all plain
greedy is verified by batched argmax/compare without the sampler's
per-position processing, `executor/verify_step.py`; false always takes the
per-position path; the tokens are the same).

Torch-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.drafter import Drafter
from tokenspeed.scheduler.speculation import DraftPolicy

HOST_METHODS = ("ngram", "suffix")
DEVICE_METHODS = ("mtp", "eagle", "eagle3", "draft_model")
METHODS = HOST_METHODS + DEVICE_METHODS
MAX_SPECULATIVE_TOKENS = 64
_NEEDS_MODEL = ("eagle", "eagle3", "draft_model")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    adaptive_draft_length: bool = True
    draft_token_cost: float = 0.1
    draft_cuda_graphs: bool = True
    fast_greedy_verify: bool = True

    @property
    def drafts_on_device(self) -> bool:
        return self.method in DEVICE_METHODS

    def draft_policy(self) -> DraftPolicy:
        """The scheduler's side of this configuration."""
        return DraftPolicy(
            method=self.method,
            num_speculative_tokens=self.num_speculative_tokens,
            on_device=self.drafts_on_device,
            adaptive=self.adaptive_draft_length,
            draft_token_cost=self.draft_token_cost,
            disable_by_batch_size=self.disable_by_batch_size,
        )

    def make_drafter(self) -> Drafter | None:
        """The host drafter the scheduler owns (None for device drafters)."""
        if self.method == "ngram":
            from tokenspeed.spec.ngram import NgramDrafter

            assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
            return NgramDrafter(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method == "suffix":
            from tokenspeed.spec.suffix import SuffixDrafter

            return SuffixDrafter(
                max_depth=self.suffix_decoding_max_tree_depth,
                max_spec_factor=self.suffix_decoding_max_spec_factor,
                min_token_prob=self.suffix_decoding_min_token_prob,
                max_corpus_documents=self.suffix_decoding_max_cached_requests,
            )
        return None


def speculative_config_dict(value: object) -> dict[str, Any] | None:
    """The option as `EngineConfig` keeps it (a JSON-friendly dict: it crosses to the engine process),
    validated now so a mistake fails before any model is loaded."""
    config = parse_speculative_config(value)
    if config is None:
        return None
    keep = ("method", "num_speculative_tokens")
    return {f.name: getattr(config, f.name) for f in fields(SpeculativeConfig)
            if f.name in keep or getattr(config, f.name) != f.default}


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """A validated `SpeculativeConfig` from a dict, a JSON object string, a config or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidRequest(f"speculative_config is not valid JSON: {err}") from None
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"speculative_config must be an object (a dict), got {type(value).__name__}.")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidRequest(f"speculative_config: unknown key(s) {unknown}; accepted: {sorted(known)}.")
    method = value.get("method")
    if method not in METHODS:
        raise InvalidRequest(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}.")
    _check_keys(method, value)
    for key in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
        if key in value:
            _check_int(key, value[key], 1, 1 << 30)
    if "suffix_decoding_max_spec_factor" in value:
        _check_float("suffix_decoding_max_spec_factor", value["suffix_decoding_max_spec_factor"], 0.0, 1e6,
                     low_open=True)
    if "suffix_decoding_min_token_prob" in value:
        _check_float("suffix_decoding_min_token_prob", value["suffix_decoding_min_token_prob"], 0.0, 1.0)
    if value.get("disable_by_batch_size") is not None:
        _check_int("disable_by_batch_size", value["disable_by_batch_size"], 1, 1 << 30)
    for key in ("adaptive_draft_length", "draft_cuda_graphs", "fast_greedy_verify"):
        if key in value and not isinstance(value[key], bool):
            raise InvalidRequest(f"speculative_config[{key!r}] must be true or false, got {value[key]!r}.")
    if "draft_token_cost" in value:
        _check_float("draft_token_cost", value["draft_token_cost"], 0.0, 100.0)
    model = value.get("model")
    if method in _NEEDS_MODEL and model is None:
        raise InvalidRequest(f"speculative_config: method {method!r} needs 'model' (the draft checkpoint).")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest(f"speculative_config['model'] must be a non-empty string, got {model!r}.")
    args = dict(value)
    args["num_speculative_tokens"] = _num_speculative_tokens(method, value)
    if method == "ngram":
        args["prompt_lookup_min"], args["prompt_lookup_max"] = _lookup_sizes(value)
    return SpeculativeConfig(**args)


def _check_keys(method: str, value: Mapping[str, object]) -> None:
    """A key that only another method uses is a mistake, not something to ignore silently."""
    for keys, owner in ((_NGRAM_KEYS, "ngram"), (_SUFFIX_KEYS, "suffix")):
        for key in keys:
            if key in value and method != owner:
                raise InvalidRequest(f"speculative_config[{key!r}] applies to method {owner!r}, not {method!r}.")
    if "model" in value and method in HOST_METHODS:
        raise InvalidRequest(f"speculative_config: method {method!r} drafts without a model; remove 'model'.")


def _num_speculative_tokens(method: str, value: Mapping[str, object]) -> int:
    k = value.get("num_speculative_tokens")
    if k is None:
        if method == "suffix":  # vLLM: up to the tree depth
            depth = value.get("suffix_decoding_max_tree_depth", 24)
            assert isinstance(depth, int)
            return min(depth, MAX_SPECULATIVE_TOKENS)
        if method == "mtp":
            return 1
        raise InvalidRequest(f"speculative_config: method {method!r} needs 'num_speculative_tokens'.")
    _check_int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
    assert isinstance(k, int)
    return k


def _lookup_sizes(value: Mapping[str, object]) -> tuple[int, int]:
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    for key, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if n is not None:
            _check_int(key, n, 1, 1024)
    if low is None and high is None:
        return 5, 5
    low = high if low is None else low
    high = low if high is None else high
    assert isinstance(low, int) and isinstance(high, int)
    if low > high:
        raise InvalidRequest(f"speculative_config: prompt_lookup_min ({low}) must not exceed prompt_lookup_max "
                             f"({high}).")
    return low, high


def _check_int(key: str, value: object, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(f"speculative_config[{key!r}] must be an integer in [{low}, {high}], got {value!r}.")


def _check_float(key: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        assert isinstance(value, int | float)
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bound = "(" if low_open else "["
        raise InvalidRequest(f"speculative_config[{key!r}] must be a finite number in {bound}{low}, {high}], "
                             f"got {value!r}.")
