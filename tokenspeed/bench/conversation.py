"""Turn a session's token plan into the messages an agent client would send.

The history is kept as a list of ``(role, content)`` messages and only
formatted per API at the edge: the chat API sends it as ``messages``, the
completions API as the contents joined by blank lines.  Either way the
request for turn k+1 starts with exactly the request for turn k followed by
the server's *actual* reply (not a synthetic one), which is what a real agent
replays and what makes prefix caching pay.

Text is synthesised lazily, one message per turn, from a seed that names the
session, the turn and a per-sweep-point salt: two concurrency points never
share session text (so one point cannot warm the cache for the next), while
the shared system prefix is the same everywhere, as in a deployment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenspeed.bench import textgen
from tokenspeed.bench.workload import SessionPlan, WorkloadPlan

Message = dict[str, str]


@dataclass(slots=True, frozen=True)
class TextRatios:
    """Characters per token of each text flavour on the server under test, plus chat framing.

    `turn_overhead` is the tokens a turn adds beyond its text (role markers of
    the reply and of the new message).  Defaults fit byte-level BPE on code;
    `calibrate.py` measures the real values through the server's usage.
    """

    system: float = 3.2
    task: float = 3.9
    tool: float = 2.7
    turn_overhead: int = 0

    def chars(self, kind: str, tokens: int) -> int:
        return max(1, round(tokens * float(getattr(self, kind))))


def system_text(seed: int, tokens: int, ratios: TextRatios) -> str:
    """The shared system + tools prefix: identical for every session and point of a run."""
    return textgen.system_prompt(random.Random(f"prefix:{seed}"), ratios.chars("system", tokens))


def _turn_text(kind: str, rng: random.Random, chars: int) -> str:
    if kind == "task":
        return textgen.user_task(rng, chars)
    return textgen.tool_output(rng, chars)


class Conversation:
    """One session's growing history; `next_messages()` then `add_reply()` per turn."""

    def __init__(
        self, plan: WorkloadPlan, session: SessionPlan, ratios: TextRatios, salt: str, prefix_text: str
    ) -> None:
        self.plan = plan
        self.session = session
        self.ratios = ratios
        self.salt = salt
        self._prefix: list[Message] = [{"role": "system", "content": prefix_text}] if plan.prefix_tokens else []
        self._history: list[Message] = list(self._prefix)
        self._turn = 0

    @property
    def turn_index(self) -> int:
        return self._turn

    def _new_message(self) -> Message:
        turn = self.session.turns[self._turn]
        rng = random.Random(f"{self.salt}:{self.session.session_id}:{self._turn}")
        return {"role": "user", "content": _turn_text(turn.kind, rng, self.ratios.chars(turn.kind, turn.new_tokens))}

    def next_messages(self) -> list[Message]:
        """The full request of the current turn (a fresh list; the caller may keep it)."""
        message = self._new_message()
        if self.plan.multi_turn:
            self._history.append(message)
            return list(self._history)
        return [*self._prefix, message]

    def add_reply(self, text: str) -> None:
        """Record the server's reply to the current turn and move to the next."""
        if self.plan.multi_turn:
            self._history.append({"role": "assistant", "content": text})
        self._turn += 1


def completion_prompt(messages: list[Message]) -> str:
    """The completions-API form of a history: each content followed by a blank line.

    The trailing separator makes the model reply after a blank line, so the
    next turn's prompt (this prompt + reply + blank line + tool output) starts
    with this prompt byte for byte.
    """
    return "".join(m["content"] + "\n\n" for m in messages)
