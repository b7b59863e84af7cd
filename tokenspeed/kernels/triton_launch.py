"""Launching Triton kernels on the GPU, or under Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when a kernel is
*decorated*, and its own standard library (`tl.cdiv`, `tl.max`, ...) is
decorated when `triton.language` is first imported. So CPU runs need
`TRITON_INTERPRET=1` in the environment before anything imports triton, and a
process then either interprets every kernel or compiles every kernel; there
is no mixing. `for_tensor` only checks that the launch can work and turns the
obscure failure of a compiled kernel fed CPU tensors into a clear message.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language.standard as tl_standard
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction

# Activation dtypes the Triton kernels are written and tested for.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_active() -> bool:
    """Whether this process imported triton with TRITON_INTERPRET=1 (kernels then run on CPU tensors)."""
    return isinstance(tl_standard.cdiv, InterpretedFunction)


def _patch_interpreter_scalar_index() -> None:
    """Let interpreted kernels use runtime scalars as loop bounds again under numpy >= 2.4.

    Triton 3.6's interpreter converts a scalar (a 1-element array) with
    `int(array)`, which numpy 2.4 refuses. We add one more patch on top of the
    interpreter's own, through its scope so it is undone with the others.
    """
    original = _interpreter._patch_lang_tensor
    if getattr(original, "_tokenspeed_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tokenspeed_patched = True  # type: ignore[attr-defined]
    _interpreter._patch_lang_tensor = patched


if interpreter_active():
    _patch_interpreter_scalar_index()


def for_tensor(kernel: Any, x: torch.Tensor) -> Any:
    """`kernel`, after checking it can be launched on `x.device`."""
    if x.device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels run on CPU tensors only under the interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported"
        )
    return kernel


def next_power_of_2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of one CUDA device (cached: the query costs a driver call)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def sm_count_of(device: torch.device) -> int:
    """SMs of `device`; a nominal 132 (H100/H200) elsewhere, so CPU tests see GPU-like split choices."""
    if device.type == "cuda" and torch.cuda.is_available():
        return multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132
