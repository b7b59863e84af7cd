"""Fixed-shape workloads: the swe-smith multi-turn recipe and random prompts.

`swe-smith` reproduces the EvalScope multi-turn recipe behind TokenSpeed's
published runs -- a first turn of N tokens, M more tokens per later turn,
T turns, fixed reply length, no think time -- so our numbers can be put next
to those.  `random` is the classic fixed input/output length benchmark: no
prefix sharing at all, the cache-cold baseline every serving paper reports.
"""

from __future__ import annotations

import random

from tokenspeed.bench.workload import SessionPlan, TurnPlan, WorkloadPlan

SWE_SMITH_FIRST_TURN = 50_000
SWE_SMITH_TURN_TOKENS = 800
SWE_SMITH_TURNS = (10, 15)


def swe_smith_plan(
    sessions: int,
    seed: int,
    turns: int | None = None,
    first_turn_tokens: int = SWE_SMITH_FIRST_TURN,
    turn_tokens: int = SWE_SMITH_TURN_TOKENS,
    output_tokens: int = 256,
) -> WorkloadPlan:
    """Sessions of `turns` turns (default uniform in 10-15): N tokens, then +M per turn."""
    plans = []
    for index in range(sessions):
        rng = random.Random(f"swe-smith:{seed}:{index}")
        count = rng.randint(*SWE_SMITH_TURNS) if turns is None else turns
        first = TurnPlan(first_turn_tokens, output_tokens, 0.0, "tool")
        rest = [TurnPlan(turn_tokens, output_tokens, 0.0, "tool") for _ in range(count - 1)]
        plans.append(SessionPlan(f"s{index}", (first, *rest)))
    plan = WorkloadPlan("swe-smith", 0, tuple(plans), multi_turn=True, native_context=1)
    native = max((plan.final_context(s) for s in plan.sessions), default=1)
    return WorkloadPlan("swe-smith", 0, tuple(plans), multi_turn=True, native_context=native)


def random_plan(sessions: int, turns: int | None = None, input_tokens: int = 1024, output_tokens: int = 128) -> WorkloadPlan:
    """`sessions` x `turns` independent prompts of exactly `input_tokens`, replies of `output_tokens`."""
    count = 1 if turns is None else turns
    turn = TurnPlan(input_tokens, output_tokens, 0.0, "tool")
    plans = tuple(SessionPlan(f"s{index}", (turn,) * count) for index in range(sessions))
    return WorkloadPlan("random", 0, plans, multi_turn=False, native_context=input_tokens + output_tokens)
