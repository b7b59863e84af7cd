"""`LaunchTuner` on the CPU: where it must not time (CPU tensors, timing switched off) it runs the default.

Timing itself, and the rule that nothing is timed inside a CUDA graph
capture, are checked on the GPU (`test_kernels_fp8_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from tokenspeed.kernels.autotune import LaunchTuner


def _tuner(calls: list[int]) -> LaunchTuner[int]:
    def candidates(key: tuple[object, ...]) -> list[int]:
        calls.append(1)
        return [7, 3, 5]

    return LaunchTuner("test", candidates)


def test_cpu_launches_take_the_first_candidate_and_remember_it() -> None:
    calls: list[int] = []
    tuner = _tuner(calls)
    ran: list[int] = []
    assert tuner.choose((1, 2), torch.device("cpu"), ran.append) == 7
    assert tuner.choose((1, 2), torch.device("cpu"), ran.append) == 7
    assert ran == [] and len(calls) == 1  # nothing timed, candidates listed once
    assert tuner.chosen()[(1, 2)].config == 7 and tuner.chosen()[(1, 2)].timings_us == {}


def test_timing_switched_off_runs_defaults_without_touching_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_AUTOTUNE", "0")
    tuner = _tuner([])
    ran: list[int] = []
    assert tuner.choose(("k",), torch.device("cuda", 0), ran.append) == 7  # no CUDA call is made
    assert ran == []
