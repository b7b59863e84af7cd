"""The messages between the API process and the engine-core process, and their wire format.

The wire is msgpack of plain lists, dicts, strings and numbers: `[tag, fields]`.
Never pickle: a socket that unpickles runs whatever code its peer sends, and
pickle ties both ends to one Python and one class layout. Every message is a
small record here; `encode`/`decode` are the only way in and out, so a new
message type cannot silently skip the codec (the round-trip test covers each).

Direction: `AddRequest`, `AbortRequest`, `FinishStream`, `Shutdown` go to the
core; `Ready`, `StartupFailed`, `Outputs`, `RequestFailed`, `EngineFailed` come
back. Errors travel as (class name, message) and are rebuilt as the same typed
error from `tokenspeed.errors`, so an HTTP layer maps them without parsing text.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from tokenspeed import errors
from tokenspeed.engine.stream import EngineStats
from tokenspeed.kvcache.events import KVEvent, PagesRemoved, PagesStored
from tokenspeed.scheduler.plan import TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

_T = TypeVar("_T")

# ---- to the core -------------------------------------------------------------------------


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class FinishStream:
    """The front end saw a stop string in this stream: end it and free its pages."""

    stream_id: str
    reason: str
    stop_reason: str | None = None


@dataclass(slots=True)
class Shutdown:
    pass


# ---- from the core -----------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """The model is loaded; what the front end needs to validate requests."""

    pid: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    page_size: int
    num_kv_pages: int


@dataclass(slots=True)
class StartupFailed:
    error_type: str
    message: str
    traceback: str = ""


@dataclass(slots=True)
class Outputs:
    """One step's updates (maybe none) and the stats after it.

    `num_added` counts the `AddRequest`s the core has taken so far, so the front
    end knows which of its submissions the stats already reflect. `kv_events`
    are the prefix-cache page records of the step (only when the config asks
    for them: `enable_kv_cache_events`), for a cache-aware router.
    """

    updates: list[RequestUpdate]
    stats: EngineStats
    num_added: int
    kv_events: list[KVEvent] = dataclasses.field(default_factory=list)


@dataclass(slots=True)
class RequestFailed:
    """The core refused an `AddRequest` (the front end's checks let it through)."""

    request_id: str
    error_type: str
    message: str


@dataclass(slots=True)
class EngineFailed:
    """The core loop raised; the process exits after sending this."""

    error_type: str
    message: str
    traceback: str = ""


Message = (
    AddRequest
    | AbortRequest
    | FinishStream
    | Shutdown
    | Ready
    | StartupFailed
    | Outputs
    | RequestFailed
    | EngineFailed
)

_FLAT: dict[str, type[Any]] = {
    "abort": AbortRequest,
    "finish": FinishStream,
    "shutdown": Shutdown,
    "ready": Ready,
    "startup_failed": StartupFailed,
    "request_failed": RequestFailed,
    "engine_failed": EngineFailed,
}
_TAGS: dict[type[Any], str] = {cls: tag for tag, cls in _FLAT.items()} | {
    AddRequest: "add",
    Outputs: "outputs",
}


class WireFormatError(ValueError):
    """A frame that is not a message of this protocol."""


def encode(message: Message) -> bytes:
    tag = _TAGS.get(type(message))
    if tag is None:
        raise TypeError(f"{type(message).__name__} is not an IPC message")
    if isinstance(message, AddRequest):
        body: dict[str, Any] = {
            "request_id": message.request_id,
            "prompt_token_ids": message.prompt_token_ids,
            "params": params_to_wire(message.params),
        }
    elif isinstance(message, Outputs):
        body = {
            "updates": [update_to_wire(u) for u in message.updates],
            "stats": dataclasses.asdict(message.stats),
            "num_added": message.num_added,
            "kv_events": [kv_event_to_wire(e) for e in message.kv_events],
        }
    else:
        body = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    packed: bytes = msgpack.packb([tag, body], use_bin_type=True)
    return packed


def decode(frame: bytes) -> Message:
    try:
        tag, body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireFormatError(f"undecodable frame: {exc}") from exc
    if not isinstance(body, dict):
        raise WireFormatError(f"message body of {tag!r} is not a map")
    try:
        if tag == "add":
            return AddRequest(body["request_id"], body["prompt_token_ids"], params_from_wire(body["params"]))
        if tag == "outputs":
            return Outputs(
                [update_from_wire(u) for u in body["updates"]],
                EngineStats(**body["stats"]),
                body["num_added"],
                [kv_event_from_wire(e) for e in body.get("kv_events", ())],
            )
        cls = _FLAT.get(tag)
        if cls is None:
            raise WireFormatError(f"unknown message tag {tag!r}")
        message: Message = cls(**body)
        return message
    except (KeyError, TypeError, IndexError) as exc:
        raise WireFormatError(f"malformed {tag!r} message: {exc}") from exc


# ---- nested records -----------------------------------------------------------------------


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    wire["eos_token_ids"] = list(params.eos_token_ids)
    # msgpack maps take string keys only (strict_map_key): the bias travels as pairs.
    wire["logit_bias"] = None if params.logit_bias is None else [[t, b] for t, b in params.logit_bias.items()]
    spec = params.structured_outputs
    wire["structured_outputs"] = None if spec is None else spec.to_dict()
    del wire["guided_decoding"]  # the same record under its older name
    return wire


def params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    """Rebuilt through the constructor, so the core re-validates what it is sent."""
    values = dict(wire)
    values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
    if values.get("logit_bias") is not None:
        values["logit_bias"] = dict(values["logit_bias"])
    return SamplingParams(**values)


def _logprob_to_wire(entry: TokenLogprob) -> list[Any]:
    return [entry.token_id, entry.logprob, entry.rank, [[t, lp] for t, lp in entry.top]]


def _logprob_from_wire(wire: list[Any]) -> TokenLogprob:
    token_id, logprob, rank, top = wire
    return TokenLogprob(token_id, logprob, rank, [(t, lp) for t, lp in top])


def _logprobs_to_wire(entries: list[TokenLogprob] | None) -> list[list[Any]] | None:
    return None if entries is None else [_logprob_to_wire(e) for e in entries]


def _logprobs_from_wire(wire: list[list[Any]] | None) -> list[TokenLogprob] | None:
    return None if wire is None else [_logprob_from_wire(e) for e in wire]


def update_to_wire(update: RequestUpdate) -> dict[str, Any]:
    """Every field of `RequestUpdate` (new ones included: msgpack rejects what it cannot carry)."""
    wire = {f.name: getattr(update, f.name) for f in dataclasses.fields(update)}
    wire["new_logprobs"] = _logprobs_to_wire(update.new_logprobs)
    wire["new_prompt_logprobs"] = _logprobs_to_wire(update.new_prompt_logprobs)
    return wire


def update_from_wire(wire: dict[str, Any]) -> RequestUpdate:
    values = dict(wire)
    values["new_logprobs"] = _logprobs_from_wire(values["new_logprobs"])
    values["new_prompt_logprobs"] = _logprobs_from_wire(values["new_prompt_logprobs"])
    return RequestUpdate(**values)


def kv_event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, PagesStored):
        return ["stored", event.parent_hash, event.page_hashes, event.token_ids]
    return ["removed", event.page_hashes]


def kv_event_from_wire(wire: list[Any]) -> KVEvent:
    if wire[0] == "stored":
        return PagesStored(wire[1], list(wire[2]), list(wire[3]))
    if wire[0] == "removed":
        return PagesRemoved(list(wire[1]))
    raise WireFormatError(f"unknown KV event {wire[0]!r}")


# ---- engine config (a command-line argument of the core process) --------------------------


def config_to_wire(config: Any) -> str:
    """A dataclass of plain fields (`EngineConfig`) as JSON."""
    return json.dumps(dataclasses.asdict(config))


def config_from_wire(cls: type[_T], wire: str) -> _T:
    """Inverse of `config_to_wire`; JSON has no tuples, so tuple-valued fields get theirs back."""
    values = json.loads(wire)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if isinstance(f.default, tuple) and isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


# ---- errors -----------------------------------------------------------------------------


def error_from_wire(
    error_type: str, message: str, fallback: type[errors.TokenSpeedError] = errors.TokenSpeedError
) -> errors.TokenSpeedError:
    """The typed error the core raised; `fallback` (message prefixed by the type) for anything else."""
    cls = getattr(errors, error_type, None)
    if isinstance(cls, type) and issubclass(cls, errors.TokenSpeedError):
        return cls(message)
    return fallback(f"{error_type}: {message}")
