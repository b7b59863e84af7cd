"""Workload shapes: sessions of turns, in tokens, before any text exists.

A workload is planned in *tokens* (what the distributions are about and what
the tests check) and rendered to text only when a request is sent
(`conversation.py`).  Keeping the two apart lets `--max-context` shrink a
session's whole shape proportionally -- shared prefix, tool outputs, replies
-- so the same agentic workload runs against a 1K-context toy model and a
128K-context production one, and lets the tests check distributions over
thousands of sessions without synthesising gigabytes of text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

# The share of `--max-context` a planned session may fill.  Text is rendered
# from a calibrated chars-per-token ratio, which is right on average but not
# per message; the headroom absorbs that error.
CONTEXT_HEADROOM = 0.9


@dataclass(slots=True, frozen=True)
class TurnPlan:
    """One request of a session."""

    new_tokens: int  # tokens of the message this turn appends (task, tool output, or a random prompt)
    output_tokens: int  # max_tokens of the reply
    gap_s: float  # seconds between the previous reply and this request (0 for a session's first)
    kind: str  # text flavour of the new message: "task" | "tool"


@dataclass(slots=True, frozen=True)
class SessionPlan:
    """A sequence of turns; in a multi-turn workload each one extends the previous prompt."""

    session_id: str
    turns: tuple[TurnPlan, ...]


@dataclass(slots=True, frozen=True)
class WorkloadPlan:
    """Sessions plus what they share.

    `multi_turn`: each prompt is the previous prompt + the previous reply + the
    new message (agent replay).  Otherwise every turn is an independent prompt.
    `native_context`: the context the unscaled shape was built for; `--max-context`
    scales every length by ``max_context * headroom / native_context``.
    """

    name: str
    prefix_tokens: int  # shared system + tools prefix, identical in every session (0: none)
    sessions: tuple[SessionPlan, ...]
    multi_turn: bool
    native_context: int
    scale: float = 1.0

    def prompt_tokens(self, session: SessionPlan, turn_overhead: int = 0) -> list[int]:
        """Planned prompt length of each turn (replies assumed to use their full budget)."""
        lengths: list[int] = []
        context = self.prefix_tokens
        for turn in session.turns:
            if self.multi_turn:
                context += turn.new_tokens + turn_overhead
                lengths.append(context)
                context += turn.output_tokens
            else:
                lengths.append(self.prefix_tokens + turn.new_tokens + turn_overhead)
        return lengths

    def final_context(self, session: SessionPlan, turn_overhead: int = 0) -> int:
        """Largest prompt + reply of the session: what must fit in the model's context."""
        prompts = self.prompt_tokens(session, turn_overhead)
        return max((p + t.output_tokens for p, t in zip(prompts, session.turns)), default=0)

    def total_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def cap_replies(plan: WorkloadPlan, most: int) -> WorkloadPlan:
    """The plan with every reply at most `most` tokens: the same prompts' shape for less decode time
    (the sessions grow by the shorter replies only)."""
    sessions = tuple(
        SessionPlan(s.session_id, tuple(replace(t, output_tokens=min(t.output_tokens, most)) for t in s.turns))
        for s in plan.sessions
    )
    return replace(plan, sessions=sessions)


def truncate_session(
    plan: WorkloadPlan, session: SessionPlan, limit: int, turn_overhead: int = 0
) -> SessionPlan:
    """Drop the turns from the first one whose prompt + reply would pass `limit`.

    This is what an agent does when its window fills (it stops or compacts);
    the session always keeps its first turn so it is never empty.
    """
    prompts = plan.prompt_tokens(session, turn_overhead)
    keep = len(session.turns)
    for index, (prompt, turn) in enumerate(zip(prompts, session.turns)):
        if prompt + turn.output_tokens > limit:
            keep = max(index, 1)
            break
    return dataclasses.replace(session, turns=session.turns[:keep])


def _scaled(value: int, scale: float, floor: int) -> int:
    return max(floor, round(value * scale))


def fit_to_context(plan: WorkloadPlan, max_context: int | None, turn_overhead: int = 0) -> WorkloadPlan:
    """Shrink every length of `plan` by one factor so its sessions fit in `max_context`.

    Proportional shrinking keeps the *shape* -- prefix share, cache-hit rate,
    turn count, the ratio of prefill to decode -- which a hard cut would not.
    Floors (1 token per message, 2 per reply so TPOT is defined) and the chat
    template's per-turn overhead can still push a long session over; those
    lose their last turns (`truncate_session`).  With no `max_context` only
    the native truncation applies.
    """
    limit = plan.native_context if max_context is None else int(max_context * CONTEXT_HEADROOM)
    scale = min(1.0, limit / plan.native_context)
    prefix = _scaled(plan.prefix_tokens, scale, 1) if plan.prefix_tokens else 0
    sessions = tuple(
        SessionPlan(
            s.session_id,
            tuple(
                TurnPlan(_scaled(t.new_tokens, scale, 1), _scaled(t.output_tokens, scale, 2), t.gap_s, t.kind)
                for t in s.turns
            ),
        )
        for s in plan.sessions
    )
    scaled = dataclasses.replace(plan, prefix_tokens=prefix, sessions=sessions, scale=scale)
    fitted = tuple(truncate_session(scaled, s, limit, turn_overhead) for s in scaled.sessions)
    return dataclasses.replace(scaled, sessions=fitted)
