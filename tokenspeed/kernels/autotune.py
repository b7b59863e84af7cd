"""Per-shape choice among a kernel's launch configurations, timed on the device on first use.

A kernel module declares a `LaunchTuner` with a function from the launch's
shape key to its candidate configurations (the first is the default: the
measured or reasoned best guess) and calls `choose(key, run)` before
launching. The first eager call with a new key on a CUDA device times every
candidate (`run(config)` launches the kernel with it) and keeps the fastest;
later calls, and calls with the key already chosen, cost one dict lookup.

Why not `triton.autotune`: its first call times the candidates wherever it
happens, and the engine's first call of a batch size may be inside a CUDA
graph capture (timing there would record the trials into the graph) or in
the capture probe, which runs the model with torch's sync debug mode set to
raise on any synchronisation (timing synchronises). So:
- inside a capture (`torch.cuda.is_current_stream_capturing()`) nothing is
  timed: the default configuration runs and nothing is remembered;
- timing runs with the sync debug mode lifted, and restores it;
- the engine's warm-up runs every batch size eagerly before capturing it
  (`executor/cuda_graphs.py`), so every key it replays was tuned by then.

Timing: each candidate is run once (Triton compiles it), then `reps` times
with the L2 cache flushed before each run (the weights of a decode GEMV fit
in the H200's L2, and would otherwise be read from it), median of CUDA-event
times. The flush reads a buffer twice the L2 rather than writing it: a write
leaves the L2 full of dirty lines, and their write-back shares the DRAM with
the timed kernel's reads (as many bytes as a weight smaller than the L2
reads), a cost no decode step pays, and largest for the smallest weights.
Between the flush and the start event the device sleeps for twice the host
time of one call: where the host takes longer to launch a candidate (a
Triton launch from Python costs tens of microseconds) than the device takes
to flush, the device would otherwise idle between the events, and the time
would be the host's (the FP8 experts' same tiles timed 352 us in one process
and 148 us in the next, a flat floor under every candidate).
A candidate that fails to compile or launch is skipped; without memory for
the flush buffer (twice the L2) the default runs untimed. A kernel timed
alone still pays its whole launch and ramp-up, which a decode step's graph
overlaps (PDL): the FP8 decode GEMV's shapes ranked differently that way
and now come from an in-graph measurement instead (`gemm/fp8_gemv_triton.py`).
`TOKENSPEED_AUTOTUNE=0` turns timing off (the defaults run); the interpreter
and CPU tensors never time. `chosen()` reports what each key got, with the
timings, for benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger("tokenspeed.kernels")

C = TypeVar("C")
Key = tuple[Any, ...]  # a launch's shape: sizes, dtypes, flags
# `torch.cuda._sleep` counts clock cycles; at a lower clock than this the sleep only lasts longer.
_SLEEP_CYCLES_PER_S = 2.0e9


def tuning_enabled() -> bool:
    return os.environ.get("TOKENSPEED_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass(slots=True)
class TunedChoice(Generic[C]):
    config: C
    timings_us: dict[str, float]  # candidate (repr) -> median microseconds; empty: default, untimed


@dataclass(slots=True)
class LaunchTuner(Generic[C]):
    """Which of `candidates(key)` to launch for a key; see the module docstring."""

    name: str
    candidates: Callable[[Key], Sequence[C]]
    reps: int = 12
    _chosen: dict[Key, TunedChoice[C]] = field(default_factory=dict)

    def default(self, key: Key) -> C:
        return self.candidates(key)[0]

    def choose(self, key: Key, device: torch.device, run: Callable[[C], object]) -> C:
        """The configuration for `key`: remembered, timed now, or the default where timing is not allowed."""
        known = self._chosen.get(key)
        if known is not None:
            return known.config
        options = self.candidates(key)
        if len(options) == 1 or device.type != "cuda" or not tuning_enabled():
            self._chosen[key] = TunedChoice(options[0], {})
            return options[0]
        if torch.cuda.is_current_stream_capturing():
            return options[0]  # never time inside a capture; the eager warm-up tunes this key
        choice = self._time(options, device, run)
        self._chosen[key] = choice
        logger.info("%s %s: %s (%s)", self.name, key, choice.config, choice.timings_us)
        return choice.config

    def chosen(self) -> dict[Key, TunedChoice[C]]:
        return dict(self._chosen)

    def _time(self, options: Sequence[C], device: torch.device, run: Callable[[C], object]) -> TunedChoice[C]:
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        try:
            flush = torch.empty(2 * max(l2_bytes, 1 << 20) // 4, dtype=torch.int32, device=device)
        except torch.OutOfMemoryError:
            logger.warning("%s: no memory to time candidates; the default configuration runs", self.name)
            return TunedChoice(options[0], {})
        with synchronisation_allowed():
            timings: dict[str, float] = {}
            best: tuple[float, C] | None = None
            for config in options:
                try:
                    us = _median_us(functools.partial(run, config), flush, self.reps)
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is just not chosen
                    logger.debug("%s: candidate %s failed: %s", self.name, config, exc)
                    continue
                timings[repr(config)] = round(us, 2)
                if best is None or us < best[0]:
                    best = (us, config)
        if best is None:
            raise RuntimeError(f"{self.name}: no candidate configuration ran")
        return TunedChoice(best[1], timings)


@contextlib.contextmanager
def synchronisation_allowed() -> Iterator[None]:
    """Lift torch's sync debug mode (the capture probe sets it to raise) for a one-time measurement or probe."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _median_us(fn: Callable[[], object], flush: torch.Tensor, reps: int) -> float:
    fn()  # compile, and fail here if the candidate cannot launch
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t  # an upper bound on the host's time to launch the candidate
    torch.cuda.synchronize()
    # The device sleeps through the host's launch (module docstring), twice its measured time, within bounds.
    sleep_cycles = int(min(max(2 * host_s, 20e-6), 5e-3) * _SLEEP_CYCLES_PER_S)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        flush.amax()  # reads only: evicts the L2 without dirtying it (module docstring)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3
