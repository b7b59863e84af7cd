"""Paged decode attention on the CPU that reads K/V pages in place (`native/paged_decode_cpu.c`, via ctypes).

Why: the torch path of the CPU decode forward (`executor/cpu_decode.py`) gathers every decode row's
pages into a padded copy (`index_select`) and runs SDPA on it; at 4-16 rows of ~500 positions on the
embedded model the copy was ~23% of the step and SDPA ~20%. The C kernel walks each row's page table
instead: per (row, kv head) one pass over the keys scores the whole GQA group, an exact fp32
softmax, one pass over the values. It is not SDPA's summation order, so it equals the torch path
within fp32 rounding (tested to 1e-5), not bit for bit.

Built on first use with the system C compiler (`-O3 -march=native`, no fast-math; `native_build.py`;
~3 s once per source version and CPU, then cached); where none works it is unavailable (logged once)
and the caller keeps the gather + SDPA path. Off switch: `TOKENSPEED_CPU_ATTENTION_NATIVE=0` (or
`--disable-cpu-paged-attention`). It runs on one thread: the CPU engine's choice for small models
(`executor/cpu_threads.py`); at two torch threads it still beat the parallel gather + SDPA on the
embedded model (`benchmarks/results/cpu/cpu_decode_paged_attention.md`), more were not measured.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tokenspeed.kernels.native_build import NativeLibrary, load_vector_library

logger = logging.getLogger("tokenspeed.kernels")

_SOURCE = Path(__file__).parent / "native" / "paged_decode_cpu.c"
MAX_GROUP = 16  # the C kernel's limits (MAX_GROUP, MAX_VECS there)
MAX_HEAD_DIM = 256


def native_enabled() -> bool:
    return os.environ.get("TOKENSPEED_CPU_ATTENTION_NATIVE", "1") != "0"


def _load() -> ctypes.CDLL:
    lib = load_vector_library(_SOURCE, "paged_decode_cpu")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_decode_attention
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr]
    fn.restype = ctypes.c_int
    return lib


NATIVE = NativeLibrary(_load, logger, "native CPU paged decode attention unavailable; gathering pages for SDPA")


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source version and CPU), or None where it cannot be built."""
    return NATIVE.get()


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the C kernel takes these head shapes (8-lane vectors, the group and head size it holds)."""
    return (head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


class PagedDecodePlan:
    """One step's one-token rows as the kernel reads them, checked once and reused by every layer.

    page_table int32 `[rows, >= pages]` with a contiguous last dim; seq_lens int64 `[rows]` contiguous,
    each in 1..max_seq_len (checked again in C, as are the page ids, before anything is read). Why a plan:
    a call's checks and buffers cost ~9 us in Python against ~0.3 us of work at B=1 and a short context;
    the step-level ones are made here once, and a layer's call (`__call__`) checks only q and the caches.
    """

    __slots__ = ("_lib", "_table", "_lens", "max_seq_len", "heads", "kv_heads", "head_dim", "page_size",
                 "_scratch", "_args")

    def __init__(self, page_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, *, heads: int,
                 kv_heads: int, head_dim: int, page_size: int) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("the native CPU paged decode attention could not be built")
        if not supports(heads, kv_heads, head_dim):
            raise ValueError(f"unsupported head shapes: {heads} heads, {kv_heads} kv heads, head_dim {head_dim}")
        if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int64:
            raise TypeError("an int32 page table and int64 lengths")
        rows = page_table.shape[0]
        if page_table.stride(1) != 1 or not seq_lens.is_contiguous() or seq_lens.shape != (rows,):
            raise ValueError("page table rows and lengths must be contiguous, a length per row")
        if page_table.shape[1] * page_size < max_seq_len:
            raise ValueError("the page table is not wide enough for max_seq_len")
        self._lib = lib
        self._table, self._lens = page_table, seq_lens  # kept alive while the kernel reads them
        self.max_seq_len, self.heads, self.kv_heads, self.head_dim = max_seq_len, heads, kv_heads, head_dim
        self.page_size = page_size
        self._scratch = torch.empty(heads // kv_heads * (-(-max_seq_len // 8) * 8), dtype=torch.float32)
        self._args = (page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), rows, max_seq_len, heads,
                      kv_heads, head_dim, page_size)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The rows' attention, `[rows, heads, head_dim]`: q `[rows, heads, head_dim]` fp32 (rows may be
        strided: a view of the fused q/k rows); the caches `[pages, page_size, kv_heads, head_dim]` fp32,
        contiguous."""
        rows, heads, head_dim = self._args[3], self.heads, self.head_dim
        if q.dtype != torch.float32 or q.shape != (rows, heads, head_dim) or q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError(f"q must be fp32 [{rows}, {heads}, {head_dim}] with contiguous rows")
        expected = (self.page_size, self.kv_heads, head_dim)
        if (k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32 or k_cache.shape[1:] != expected
                or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise ValueError(f"contiguous fp32 K and V caches of one shape [pages, {', '.join(map(str, expected))}]")
        out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
        table, stride, lens, _, max_len, _, kv_heads, _, page_size = self._args
        status = self._lib.paged_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], table, stride, lens,
            rows, max_len, heads, kv_heads, head_dim, page_size, scale, self._scratch.data_ptr(), out.data_ptr(),
        )
        if status != 0:
            raise ValueError({
                -1: "unsupported head shapes",
                -2: f"a sequence length outside 1..{max_len}",
                -3: "a page id outside the KV pool",
            }[status])
        return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One-token rows' attention over their pages, `[rows, heads, head_dim]` (one call of a
    `PagedDecodePlan`: see there for the layouts)."""
    _, page_size, kv_heads, _ = k_cache.shape
    if page_table.shape[0] != q.shape[0]:
        raise ValueError("a page table row per q row")
    plan = PagedDecodePlan(page_table, seq_lens, max_seq_len, heads=q.shape[1], kv_heads=kv_heads,
                           head_dim=q.shape[2], page_size=page_size)
    return plan(q, k_cache, v_cache, scale)
