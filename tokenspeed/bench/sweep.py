"""Run one concurrency point: C agents, each replaying whole sessions.

Concurrency means concurrent *sessions* (agents), not concurrent requests: an
agent sends a turn, waits for the reply, runs its tool (sleeps the planned
gap x `time_scale`) and sends the next turn, so at any moment some of the C
agents are thinking and hold no request.  That is the load a coding-agent
fleet puts on a server, and it is what session retention is for.  Agents
pull sessions from one queue until it is empty.

A session is also ended early when the server's own token counts say the
next turn could not fit in `max_context` (the synthesiser plans with an
estimated chars/token; the server has the final word).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from tokenspeed.bench.client import RequestOptions, RequestRecord, stream_request
from tokenspeed.bench.conversation import Conversation, TextRatios
from tokenspeed.bench.workload import SessionPlan, WorkloadPlan

# How much longer than planned a message may tokenize (text flavours vary
# around the calibrated mean); used only to stop a session before overflow.
_TOKEN_ESTIMATE_SLACK = 1.25


@dataclass(slots=True)
class PointRun:
    """The raw outcome of one point."""

    concurrency: int
    sessions: int
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    sessions_cut: int = 0  # sessions ended early because the next turn would not fit


@dataclass(slots=True, frozen=True)
class PointSpec:
    """Everything a point needs besides the HTTP client."""

    plan: WorkloadPlan
    sessions: Sequence[SessionPlan]
    concurrency: int
    ratios: TextRatios
    prefix_text: str
    salt: str
    time_scale: float = 1.0
    max_context: int | None = None


def _would_overflow(spec: PointSpec, previous: RequestRecord, session: SessionPlan, turn: int) -> bool:
    if spec.max_context is None or not spec.plan.multi_turn or not previous.usage_reported:
        return False
    nxt = session.turns[turn]
    estimate = (
        previous.prompt_tokens
        + previous.output_tokens
        + spec.ratios.turn_overhead
        + nxt.new_tokens * _TOKEN_ESTIMATE_SLACK
        + nxt.output_tokens
    )
    return estimate > spec.max_context


async def _play_session(
    http: httpx.AsyncClient,
    options: RequestOptions,
    spec: PointSpec,
    session: SessionPlan,
    start: float,
    run: PointRun,
    on_record: Callable[[RequestRecord], None],
) -> None:
    conversation = Conversation(spec.plan, session, spec.ratios, spec.salt, spec.prefix_text)
    previous: RequestRecord | None = None
    for index, turn in enumerate(session.turns):
        if previous is not None:
            if turn.gap_s > 0 and spec.time_scale > 0:
                await asyncio.sleep(turn.gap_s * spec.time_scale)
            if _would_overflow(spec, previous, session, index):
                run.sessions_cut += 1
                return
        messages = conversation.next_messages()
        record = RequestRecord(session.session_id, index, start_s=time.perf_counter() - start)
        reply = await stream_request(http, options, messages, turn.output_tokens, record)
        run.records.append(record)
        on_record(record)
        if not record.ok:
            return  # the history is broken; an agent would give up too
        conversation.add_reply(reply)
        previous = record


async def run_point(
    http: httpx.AsyncClient,
    options: RequestOptions,
    spec: PointSpec,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> PointRun:
    """Play `spec.sessions` with `spec.concurrency` agents; time from first send to last reply."""
    queue: asyncio.Queue[SessionPlan] = asyncio.Queue()
    for session in spec.sessions:
        queue.put_nowait(session)
    run = PointRun(spec.concurrency, len(spec.sessions))
    start = time.perf_counter()

    async def agent() -> None:
        while not queue.empty():
            session = queue.get_nowait()
            await _play_session(http, options, spec, session, start, run, on_record)

    await asyncio.gather(*(agent() for _ in range(spec.concurrency)))
    run.duration_s = time.perf_counter() - start
    return run
