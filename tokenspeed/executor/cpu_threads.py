"""How many intra-op (OpenMP) threads the CPU forward gets, chosen once at engine start.

Every front end (`LLM`, `generate`, `chat`, `serve`) builds an `Executor`,
which calls `apply_cpu_threads`, so they all make the same choice:

- `--cpu-threads N` / `cpu_threads=N`: exactly N;
- otherwise every core this process may use, less one when an API process
  (HTTP, tokenizer, detokenizer) shares the machine (`serve`: the engine
  process calls `reserve_api_core` first), and no more threads than the
  model can keep busy: one per `PARAMS_PER_THREAD` weights.

Why the cap: an OpenMP region ends in a barrier that waits for its slowest
thread. A small model's ops take microseconds, so the barrier is the cost;
and on a machine shared with other processes a descheduled thread holds
every barrier for a scheduler slice. Measured on the embedded model (4.5M
parameters) on 2 vCPUs with load ~4 from other processes: 16 requests of
512+64 tokens ran at 420 output tok/s with one thread and 89 with two;
one request at 136 vs 17.
"""

from __future__ import annotations

import logging
import os

import torch

from tokenspeed.config import default_cpu_threads

logger = logging.getLogger("tokenspeed.executor")

# Weights one extra thread needs before it pays for its barriers. A decode step streams every
# weight once; 50M fp32 parameters are 200 MB, ~10 ms of one core's bandwidth, against barrier
# costs of tens of microseconds per op (hundreds of ops a step) that grow badly under load.
PARAMS_PER_THREAD = 50_000_000

_api_core_reserved = False


def reserve_api_core() -> None:
    """This process serves an API process on the same machine: automatic choices leave it a core."""
    global _api_core_reserved
    _api_core_reserved = True


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0))


def auto_cpu_threads(num_params: int, *, api_process: bool, cores: int | None = None) -> int:
    """Threads for a model of `num_params` weights: the usable cores (less one for an API process),
    at most one per `PARAMS_PER_THREAD` weights, at least one."""
    if cores is None:
        available = default_cpu_threads() if api_process else usable_cores()
    else:
        available = max(1, cores - 1) if api_process else cores
    return max(1, min(available, num_params // PARAMS_PER_THREAD))


def apply_cpu_threads(requested: int | None, num_params: int) -> int:
    """Set torch's intra-op thread count for this process (explicit `requested` wins); returns it."""
    threads = requested if requested is not None else auto_cpu_threads(num_params, api_process=_api_core_reserved)
    torch.set_num_threads(threads)
    logger.info(
        "CPU threads: %d of %d usable cores (%s)",
        threads,
        usable_cores(),
        "--cpu-threads" if requested is not None
        else f"{num_params / 1e6:.1f}M parameters{', one core left to the API process' if _api_core_reserved else ''}",
    )
    return threads
