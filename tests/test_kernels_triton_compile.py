"""Every Triton kernel compiles for sm_90 on this (GPU-less) machine, without register spills beyond its allowance,
and no fp8 kernel reads shared memory a byte at a time (an fp8 tile Triton transposes for a dot unwidened).

The interpreter tests (`test_kernels_triton.py`) check what kernels compute but
run them as Python, so compile-only mistakes would first surface on the GPU
machine. This runs `python -m tokenspeed.kernels.compile_check` in a fresh
process, since a process that interprets Triton kernels cannot compile them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
@pytest.mark.slow  # ~45 s of compiling; the GPU suite compiles and runs the same kernels
def test_triton_kernels_compile_for_hopper_without_spills() -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "tokenspeed.kernels.compile_check", "--arch", "90"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    spills = re.findall(
        r"^ok\s+(.*): .*spill_stores=(\d+)B(?: allowance=(\d+)B)?$", result.stdout, flags=re.MULTILINE
    )
    assert spills, result.stdout
    assert [name for name, stored, allowed in spills if int(stored) > int(allowed or 0)] == []
    byte_loads = re.findall(r"^ok\s+(.*fp8.*): .*shared_byte_loads=(\d+)", result.stdout, flags=re.MULTILINE)
    assert byte_loads, result.stdout
    assert [name for name, loads in byte_loads if int(loads)] == []  # fp8 tiles are widened before transposes
