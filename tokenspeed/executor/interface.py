"""`ModelExecutor`: what the engine core needs from whatever runs the model.

The core (`engine/core.py`) is a loop: plan, launch, advance. Everything that
touches a device sits behind these three members, so an executor can be
replaced or wrapped without the core noticing:

- `limits`: what the executor can hold (vocabulary, context, KV pages), known
  once it is built; the core sizes its scheduler from it;
- `launch(plan, previous)`: start running one `ExecutionPlan` and return a
  handle at once. `previous` is the handle of the step still in flight, whose
  sampled ids the plan's placeholder inputs stand for (overlap scheduling);
  plans are launched once each, in the order they were made, because they are
  incremental (the executor keeps each running request's page table);
- `collect(handle)`: wait for that step and return its `ExecutionResult`.

An executor that holds device memory also has `close()`, which frees it
(weights, KV pool, CUDA graphs); `EngineCore.shutdown()` calls it where it
exists, so `LLM.shutdown()` gives the device back.

Implementations: `Executor` (one device, `executor.py`) and the torch-free
`SimulatedExecutor` (`scheduler/simulated_executor.py`, tests and the
scheduler benchmark). A tensor-parallel executor broadcasts each plan to its
workers and collects rank 0's result; a speculative verifier or a host-KV-tier
copier wraps another executor and forwards these calls. The handle type is the
implementation's own; the core only passes it back.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ExecutorLimits

HandleT = TypeVar("HandleT")


@runtime_checkable
class ModelExecutor(Protocol[HandleT]):
    @property
    def limits(self) -> ExecutorLimits: ...

    def launch(self, plan: ExecutionPlan, previous: HandleT | None = None) -> HandleT: ...

    def collect(self, handle: HandleT) -> ExecutionResult: ...
