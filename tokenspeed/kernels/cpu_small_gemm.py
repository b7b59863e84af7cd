"""fp32 GEMMs of few rows on the CPU in C (`native/cpu_small_gemm.c`, via ctypes): decode steps' linears.

Why: at 1-16 rows the CPU forward's GEMMs are small, and MKL (`F.linear`) and oneDNN (packed) both
spend most of their time outside the multiply-adds. On a weight packed once as `[out / 16, in, 16]`
a tile of up to 16 rows keeps its outputs in registers: on the embedded model's shapes (one thread)
1.1-2.4x faster than the better of the two at 1-16 rows (`benchmarks/results/cpu/cpu_fused_ops.md`).
`executor/cpu_linear.py` runs it up to `MAX_ROWS` rows and keeps oneDNN / MKL above. Within fp32
rounding of `F.linear`, not bit for bit. Off: `TOKENSPEED_CPU_SMALL_GEMM=0`, or with the GEMM prepacking
(`--disable-cpu-gemm-prepack`); where no C compiler works it is unavailable (logged once).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tokenspeed.kernels.native_build import NativeLibrary, load_vector_library

logger = logging.getLogger("tokenspeed.kernels")

_SOURCE = Path(__file__).parent / "native" / "cpu_small_gemm.c"
ENV_SWITCH = "TOKENSPEED_CPU_SMALL_GEMM"
MAX_ROWS = 16  # rows up to which the kernel runs (measured faster at 1-16; prefill chunks keep oneDNN)


def native_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _load() -> ctypes.CDLL:
    lib = load_vector_library(_SOURCE, "cpu_small_gemm")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.small_gemm.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    lib.small_gemm.restype = None
    return lib


NATIVE = NativeLibrary(_load, logger, "native CPU small GEMM unavailable; few-row linears keep MKL / oneDNN")


def load_library() -> ctypes.CDLL | None:
    return NATIVE.get()


class SmallGemm:
    """`x @ weight.T` for fp32 rows on a copy of `weight` (`[out, in]`, out a multiple of 16) packed once."""

    __slots__ = ("_lib", "packed", "out_features", "in_features")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor) -> None:
        out, k = weight.shape
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or out % 16 or out == 0 or k == 0:
            raise ValueError(f"an fp32 CPU weight with a multiple of 16 output features, not {tuple(weight.shape)}")
        self._lib = lib
        self.packed = weight.detach().reshape(out // 16, 16, k).transpose(1, 2).contiguous()  # [out/16, in, 16]
        self.out_features, self.in_features = out, k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 `[rows, in]` on the CPU (rows strided or not, the last dim contiguous)."""
        if x.dtype is not torch.float32 or not x.is_cpu or x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"small_gemm: fp32 CPU rows of {self.in_features}")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty((rows, self.out_features), dtype=torch.float32)
        if rows:
            self._lib.small_gemm(x.data_ptr(), x.stride(0), rows, self.packed.data_ptr(), self.in_features,
                                 self.out_features, y.data_ptr())
        return y


def small_gemm(weight: torch.Tensor) -> SmallGemm | None:
    """A `SmallGemm` of `weight` where the kernel builds, is on and takes the shape; else None."""
    if not native_enabled() or weight.dim() != 2 or weight.shape[0] % 16 or weight.dtype != torch.float32:
        return None
    lib = load_library()
    return None if lib is None else SmallGemm(lib, weight)
