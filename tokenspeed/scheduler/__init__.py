"""The control plane: request FSM, admission, chunked prefill, preemption.

Pure Python (no torch): `Scheduler.next_plan()` says what the executor runs,
`Scheduler.advance()` records what it produced. One request is one sample:
`n > 1` is fanned out into n requests by the front end (`engine/fan_out.py`),
which share the prompt's pages through the prefix cache. See docs/architecture.md.
"""

from __future__ import annotations

from tokenspeed.scheduler.config import SchedulerConfig
from tokenspeed.scheduler.fsm import (
    Admit,
    ChunkDone,
    Decoding,
    Finish,
    Finished,
    IllegalTransition,
    Preempt,
    PrefillDone,
    Prefilling,
    Restore,
    Retract,
    Retracted,
    Transition,
    Waiting,
    transition,
)
from tokenspeed.scheduler.plan import (
    ExecutionPlan,
    ExecutionResult,
    ExecutorLimits,
    RowOutput,
    ScheduledRow,
    TokenLogprob,
)
from tokenspeed.scheduler.request import Request, TokenView
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.scheduler import Scheduler
from tokenspeed.scheduler.updates import RequestUpdate

__all__ = [
    "Admit",
    "ChunkDone",
    "Decoding",
    "ExecutionPlan",
    "ExecutionResult",
    "ExecutorLimits",
    "Finish",
    "Finished",
    "IllegalTransition",
    "Prefilling",
    "Preempt",
    "PrefillDone",
    "Request",
    "RequestUpdate",
    "Restore",
    "Retract",
    "Retracted",
    "RowOutput",
    "SamplingParams",
    "ScheduledRow",
    "Scheduler",
    "SchedulerConfig",
    "TokenLogprob",
    "TokenView",
    "Transition",
    "Waiting",
    "transition",
]
