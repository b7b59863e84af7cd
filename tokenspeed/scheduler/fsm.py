"""The request state machine: typestate classes, events, one transition function.

Each state is its own class and owns exactly the KV handles that state may
hold: `Prefilling` and `Decoding` own a `BlockTable`; `Waiting` and
`Finished` own none. `transition` is the only place a request changes state;
every handle either moves into the new state (`BlockTable.move()`, so the old
state object can never touch the pages again) or is handed back to the caller
in `Transition.dropped`, which must publish/release it. An event that makes
no sense in the current state raises `IllegalTransition` instead of being
ignored: a scheduler bug surfaces at the step that caused it.

`Retracted` owns a `Retraction` (kvcache/retraction.py): the victim's table
is moved into the `save` function of the `Retract` event, which copies its
private pages to the host and returns the handle; `Restore` brings a new
device table back (the retraction is consumed by `KVCache.restore`), and a
request finished while retracted hands its retraction back in
`Transition.retraction` for the caller to discard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenspeed.errors import TokenSpeedError
from tokenspeed.kvcache import BlockTable, Retraction


class IllegalTransition(TokenSpeedError, RuntimeError):
    """An event arrived in a state where it is not allowed."""


# ---- states ------------------------------------------------------------------


@dataclass(slots=True)
class Waiting:
    """Submitted, or preempted and queued for recompute. Owns no pages."""


@dataclass(slots=True)
class Prefilling:
    """Some of the tokens still need computing; owns the request's pages."""

    table: BlockTable


@dataclass(slots=True)
class Decoding:
    """Exactly one token (the last sampled) is uncomputed; owns the request's pages."""

    table: BlockTable


@dataclass(slots=True)
class Retracted:
    """Preempted with its KV saved: private pages on the host, shared ones left to the prefix cache."""

    retraction: Retraction


@dataclass(slots=True, frozen=True)
class Finished:
    """Terminal. Owns no pages."""

    reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


State = Waiting | Prefilling | Decoding | Retracted | Finished


# ---- events ------------------------------------------------------------------


@dataclass(slots=True)
class Admit:
    """Waiting -> Prefilling with `table` (prefix-cache hits plus the first chunk's pages)."""

    table: BlockTable


@dataclass(slots=True)
class ChunkDone:
    """Prefilling -> Prefilling: a chunk that did not reach the end was computed."""


@dataclass(slots=True)
class PrefillDone:
    """Prefilling -> Decoding: the last chunk was computed and a token sampled."""


@dataclass(slots=True)
class Preempt:
    """Prefilling/Decoding -> Waiting: pages given up, to be recomputed later."""


@dataclass(slots=True)
class Retract:
    """Prefilling/Decoding -> Retracted: `save` takes the table and returns the retraction to own."""

    save: Callable[[BlockTable], Retraction]


@dataclass(slots=True)
class Restore:
    """Retracted -> Prefilling with `table` (the restored pages; the rest is computed as a prefill)."""

    table: BlockTable


@dataclass(slots=True)
class Finish:
    """Any live state -> Finished."""

    reason: str
    stop_reason: int | str | None = None


Event = Admit | ChunkDone | PrefillDone | Preempt | Retract | Restore | Finish


@dataclass(slots=True)
class Transition:
    state: State
    # Handles the new state does not own; the caller must consume each one.
    dropped: list[BlockTable] = field(default_factory=list)
    # A retraction the new state does not own (finished while retracted); the caller discards it.
    retraction: Retraction | None = None


def _owned(state: Prefilling | Decoding) -> list[BlockTable]:
    return [state.table.move()]


def transition(state: State, event: Event) -> Transition:
    """The one place a request changes state. Raises IllegalTransition for any other pair."""
    match state, event:
        case Waiting(), Admit(table=table):
            return Transition(Prefilling(table.move()))
        case Prefilling(table=table), ChunkDone():
            return Transition(Prefilling(table.move()))
        case Prefilling(table=table), PrefillDone():
            return Transition(Decoding(table.move()))
        case Prefilling() | Decoding(), Preempt():
            return Transition(Waiting(), _owned(state))
        case Prefilling() | Decoding(), Retract(save=save):
            return Transition(Retracted(save(state.table.move())))
        case Retracted(), Restore(table=table):
            return Transition(Prefilling(table.move()))
        case Waiting(), Finish(reason=reason, stop_reason=stop_reason):
            return Transition(Finished(reason, stop_reason))
        case Retracted(retraction=retraction), Finish(reason=reason, stop_reason=stop_reason):
            return Transition(Finished(reason, stop_reason), retraction=retraction)
        case Prefilling() | Decoding(), Finish(reason=reason, stop_reason=stop_reason):
            return Transition(Finished(reason, stop_reason), _owned(state))
    raise IllegalTransition(f"event {type(event).__name__} is illegal in state {type(state).__name__}")
