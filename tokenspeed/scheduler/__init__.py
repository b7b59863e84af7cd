"""The control plane: request FSM, admission, chunked prefill, preemption, forks.

Pure Python (no torch): `Scheduler.next_plan()` says what the executor runs,
`Scheduler.advance()` records what it produced. See DESIGN.md.
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
    ReserveForkPages,
    Transition,
    Waiting,
    transition,
)
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, RowOutput, ScheduledRow, TokenLogprob
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
    "Finish",
    "Finished",
    "IllegalTransition",
    "Prefilling",
    "Preempt",
    "PrefillDone",
    "ReserveForkPages",
    "Request",
    "RequestUpdate",
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
