"""Triton kernel tests on the CPU, under Triton's interpreter.

Triton chooses between interpreting and compiling when `triton.language` is
first imported, so a kernel test module imports this module before anything
imports triton (the conftest does not): without CUDA it sets
TRITON_INTERPRET=1. Should triton already be loaded in compiled mode (another
module imported it first), the tests marked `interpreted` skip and the
module's `test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)`
reruns the file in a fresh process instead. With CUDA present the GPU test
files cover the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tokenspeed.kernels.triton_launch import interpreter_active  # noqa: E402

INTERPRETING = interpreter_active()
interpreted = pytest.mark.skipif(
    not INTERPRETING, reason="triton was imported without TRITON_INTERPRET=1 (see the fresh-process test)"
)


def fresh_process_test(path: str, *pytest_args: str, slow: bool = False) -> Callable[[], None]:
    """A test that reruns the test file `path` (with `pytest_args`) under the interpreter in a new process.

    `slow`: the suite takes over ten seconds interpreted, so it runs in `make test-slow`, not in
    `make test` (which must finish on two cores within CI's fifteen minutes).
    """

    @pytest.mark.skipif(
        INTERPRETING or torch.cuda.is_available(), reason="the kernels already run in-process"
    )
    def test_interpreter_suite_in_fresh_process() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, path]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

    return pytest.mark.slow(test_interpreter_suite_in_fresh_process) if slow else test_interpreter_suite_in_fresh_process
