"""Fused elementwise ops of the CPU forward in C (`native/cpu_fused.c`, via ctypes).

Why: between its GEMMs a layer of the CPU forward (`executor/cpu_decode.py`) ran ~20 torch ops over
its rows: residual add + RMSNorm (5 ops), q/k RMSNorm, RoPE (4 ops), the K/V writes, SiLU and the
gate product. On a 512-token prefill of the embedded model they were ~4.7 ms of ~31 (each op a full
pass over memory); on a few-row decode step each costs ~3-5 us of dispatch against well under a
microsecond of work. Here each group is one call and one pass per row (see the C source for what
each computes). The results equal the torch ops' within fp32 rounding (another summation order for
the RMS, a ~1 ulp exp), not bit for bit.

Built on first use with the system C compiler (`native_build.py`, cached); where none works
`load_library` returns None (logged once) and the caller keeps its torch ops. Off switch:
`TOKENSPEED_CPU_FUSED_OPS=0` (or `--disable-cpu-fused-ops`). Every function checks dtypes, shapes
and strides before the pointers go to C, and the C side checks positions and KV slots.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tokenspeed.kernels.native_build import NativeLibrary, load_vector_library

logger = logging.getLogger("tokenspeed.kernels")

_SOURCE = Path(__file__).parent / "native" / "cpu_fused.c"
ENV_SWITCH = "TOKENSPEED_CPU_FUSED_OPS"


def native_enabled() -> bool:
    """Whether to use the fused ops where the config does not say: yes unless `TOKENSPEED_CPU_FUSED_OPS=0`."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _load() -> ctypes.CDLL:
    lib = load_vector_library(_SOURCE, "cpu_fused")
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.add_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32]
    lib.qk_norm_rope_store.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, f32, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64]
    lib.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
    for fn in (lib.add_rms_norm, lib.qk_norm_rope_store, lib.silu_mul):
        fn.restype = ctypes.c_int
    return lib


NATIVE = NativeLibrary(_load, logger, "native CPU fused ops unavailable; the CPU forward keeps its torch ops")


def load_library() -> ctypes.CDLL | None:
    """The compiled ops (built once per source version and CPU), or None where they cannot be built."""
    return NATIVE.get()


def supports(*dims: int) -> bool:
    """Whether the C ops take these widths (8-lane vectors)."""
    return all(d > 0 and d % 8 == 0 for d in dims)


def _fp32(t: torch.Tensor) -> bool:
    """Contiguous fp32 on the CPU (the cheapest checks: ~0.3 us; a generator over tensors cost ~1 us more)."""
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


class CPUFusedOps:
    """The three fused ops of one model's shapes on the loaded library (see the C source for the arithmetic).

    What does not change between calls (the norm weights, the RoPE tables, the KV pools) is checked once,
    by `__init__` and `check_*`; a call checks only its activations (dtype, contiguity, width), ~1 us,
    since the ops run ~12 times a layer on decode steps whose torch ops cost ~1.5-3 us each.
    """

    __slots__ = ("_lib", "heads", "kv_heads", "head_dim", "_cos", "_sin", "_max_pos")

    def __init__(self, lib: ctypes.CDLL, *, heads: int, kv_heads: int, head_dim: int, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> None:
        half = head_dim // 2
        if not supports(half):
            raise ValueError(f"head_dim {head_dim} is not a multiple of 16")
        if not (_fp32(cos_cache) and _fp32(sin_cache)) or cos_cache.dim() != 2 or cos_cache.shape[1] != half or \
                sin_cache.shape != cos_cache.shape:
            raise ValueError(f"contiguous fp32 RoPE tables [max_pos, {half}]")
        self._lib = lib
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._cos, self._sin = cos_cache, sin_cache  # kept alive while C reads them
        self._max_pos = cos_cache.shape[0]

    def check_norm(self, weight: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """A norm weight as the ops take it (contiguous fp32 `[dim]`, or `[rows, dim]` per head); raises if not."""
        if not _fp32(weight) or weight.shape[-1] % 8 or weight.numel() != rows * weight.shape[-1]:
            raise ValueError(f"a contiguous fp32 norm weight of {rows} rows, a multiple of 8 wide")
        return weight

    def check_kv(self, k_flat: torch.Tensor, v_flat: torch.Tensor) -> None:
        """A layer's K and V slots, `[slots, kv_heads, head_dim]` contiguous fp32 each; raises if not."""
        shape = (self.kv_heads, self.head_dim)
        if not (_fp32(k_flat) and _fp32(v_flat)) or k_flat.shape[1:] != shape or v_flat.shape != k_flat.shape:
            raise ValueError("contiguous fp32 K and V slots of one shape")

    def add_rms_norm(self, a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`a += b` in place (b None: no add), then RMSNorm of `a` with `weight` (`check_norm`): a new tensor.
        a and b contiguous fp32 `[rows, dim]`."""
        shape = a.shape
        if (not _fp32(a) or a.ndim != 2 or shape[1] != weight.shape[0]
                or (b is not None and (not _fp32(b) or b.shape != shape))):
            raise ValueError(f"add_rms_norm: contiguous fp32 rows of {weight.shape[0]}")
        out = torch.empty(shape, dtype=torch.float32)
        dim = shape[1]
        self._lib.add_rms_norm(a.data_ptr(), dim, None if b is None else b.data_ptr(), dim, weight.data_ptr(),
                               out.data_ptr(), dim, shape[0], dim, eps)
        return out

    def qk_norm_rope_store(
        self, qkv: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
        slots: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
    ) -> None:
        """In place on `qkv` (contiguous `[tokens, (heads + 2 kv_heads) * head_dim]`): the q and k heads
        RMS-normed by `norm_weight` (`check_norm` of `[heads + kv_heads, head_dim]`; None: not normed) and
        rotated at `positions` (rotate-half on the RoPE tables); then each token's k and v copied to its
        slot of `k_flat`/`v_flat` (`check_kv`). positions and slots: contiguous int64 `[tokens]` (C checks
        their range before anything is written)."""
        tokens, width = qkv.shape
        if (not _fp32(qkv) or width != (self.heads + 2 * self.kv_heads) * self.head_dim
                or positions.dtype is not torch.int64 or slots.dtype is not torch.int64 or not positions.is_cpu
                or not slots.is_cpu or positions.ndim != 1 or slots.ndim != 1 or positions.shape[0] != tokens
                or slots.shape[0] != tokens or not (positions.is_contiguous() and slots.is_contiguous())):
            raise ValueError("qk_norm_rope_store: contiguous fp32 qkv rows, int64 positions and slots per token")
        status = self._lib.qk_norm_rope_store(
            qkv.data_ptr(), width, tokens, self.heads, self.kv_heads, self.head_dim,
            None if norm_weight is None else norm_weight.data_ptr(), eps, positions.data_ptr(),
            self._cos.data_ptr(), self._sin.data_ptr(), self._max_pos, slots.data_ptr(), k_flat.data_ptr(),
            v_flat.data_ptr(), k_flat.shape[0],
        )
        if status != 0:
            raise ValueError({-1: "a position outside the RoPE table", -2: "a KV slot outside the pool"}[status])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of contiguous fp32 `[rows, 2 * dim]` rows `[gate | up]`: a new `[rows, dim]` tensor."""
        rows, width = gate_up.shape
        dim = width // 2
        if not _fp32(gate_up) or width != 2 * dim or dim % 8:
            raise ValueError("silu_mul: contiguous fp32 [gate | up] rows, each half a multiple of 8 wide")
        out = torch.empty((rows, dim), dtype=torch.float32)
        self._lib.silu_mul(gate_up.data_ptr(), width, out.data_ptr(), dim, rows, dim)
        return out
