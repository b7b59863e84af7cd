"""The agentic workload: coding-agent sessions replayed turn by turn.

A session is what a coding agent sends: a system + tool-schema prefix shared
by every session of the deployment (12-24K tokens), a task, then 10-40 turns
where each prompt is the previous prompt + the model's previous reply + the
output of the tool the reply called.  Prefix reuse is therefore exact and
grows every turn (~96% of a late prompt was seen one turn ago), which is the
property a server's prefix cache and session retention must exploit.

Shapes come from `distributions.py`; a session whose context would pass the
native window (128K) ends there, as an agent whose window filled would, so
contexts grow to roughly 60-130K.
"""

from __future__ import annotations

import random

from tokenspeed.bench.distributions import (
    PREFIX_TOKENS_RANGE,
    REPLY_TOKENS,
    TASK_TOKENS,
    TOOL_OUTPUT_TOKENS,
    TURNS,
    sample_gap_s,
)
from tokenspeed.bench.workload import SessionPlan, TurnPlan, WorkloadPlan, truncate_session

NATIVE_CONTEXT = 131_072


def _session(rng: random.Random, session_id: str, turns: int | None) -> SessionPlan:
    count = TURNS.sample(rng) if turns is None else turns
    plans = [TurnPlan(TASK_TOKENS.sample(rng), REPLY_TOKENS.sample(rng), 0.0, "task")]
    for _ in range(count - 1):
        plans.append(TurnPlan(TOOL_OUTPUT_TOKENS.sample(rng), REPLY_TOKENS.sample(rng), sample_gap_s(rng), "tool"))
    return SessionPlan(session_id, tuple(plans))


def agentic_plan(sessions: int, seed: int, turns: int | None = None) -> WorkloadPlan:
    """`sessions` agent sessions at native scale (use `fit_to_context` to shrink).

    `turns` fixes the turn count of every session (otherwise heavy-tailed 10-40).
    Session i's shape depends only on (seed, i), so a sweep that needs more
    sessions at a higher concurrency extends the same list instead of
    reshuffling it.
    """
    prefix = random.Random(f"agentic-prefix:{seed}").randint(*PREFIX_TOKENS_RANGE)
    plans = tuple(
        _session(random.Random(f"agentic:{seed}:{index}"), f"s{index}", turns) for index in range(sessions)
    )
    plan = WorkloadPlan("agentic", prefix, plans, multi_turn=True, native_context=NATIVE_CONTEXT)
    truncated = tuple(truncate_session(plan, s, NATIVE_CONTEXT) for s in plan.sessions)
    return WorkloadPlan("agentic", prefix, truncated, multi_turn=True, native_context=NATIVE_CONTEXT)
