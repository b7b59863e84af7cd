"""Paged decode attention on the CPU that reads K/V pages in place (`native/paged_decode_cpu.c`, via ctypes).

Why: the torch path of the CPU decode forward (`executor/cpu_decode.py`) gathers every decode row's
pages into a padded copy (`index_select`) and runs SDPA on it; at 4-16 rows of ~500 positions on the
embedded model the copy was ~23% of the step and SDPA ~20%. The C kernel walks each row's page table
instead: per (row, kv head) one pass over the keys scores the whole GQA group, an exact fp32
softmax, one pass over the values. It is not SDPA's summation order, so it equals the torch path
within fp32 rounding (tested to 1e-5), not bit for bit.

Built on first use with the system C compiler (`-O3 -march=native`, no fast-math; `native_build.py`);
where none works it is unavailable (logged once) and the caller keeps the gather + SDPA path. Off
switch: `TOKENSPEED_CPU_ATTENTION_NATIVE=0` (or `--disable-cpu-paged-attention`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tokenspeed.native_build import build_library

logger = logging.getLogger("tokenspeed.kernels")

_SOURCE = Path(__file__).parent / "native" / "paged_decode_cpu.c"
_LIB: ctypes.CDLL | None = None
_TRIED = False
MAX_GROUP = 16  # the C kernel's limits (MAX_GROUP, MAX_VECS there)
MAX_HEAD_DIM = 256


def native_enabled() -> bool:
    return os.environ.get("TOKENSPEED_CPU_ATTENTION_NATIVE", "1") != "0"


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source version and CPU), or None where it cannot be built."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    try:
        try:
            path = build_library(_SOURCE, "paged_decode_cpu", ["-O3", "-march=native", "-std=gnu99"])
        except Exception:  # a compiler without -march=native: the generic vector code
            path = build_library(_SOURCE, "paged_decode_cpu", ["-O3", "-std=gnu99", "-Wno-psabi"])
        lib = ctypes.CDLL(str(path))
    except Exception as err:  # no compiler, unwritable cache, ...: the torch path serves
        logger.info("native CPU paged decode attention unavailable (%s); gathering pages for SDPA", err)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_decode_attention
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr]
    fn.restype = ctypes.c_int
    _LIB = lib
    return _LIB


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the C kernel takes these head shapes (8-lane vectors, the group and head size it holds)."""
    return (head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One-token rows' attention over their pages, `[rows, heads, head_dim]`.

    q `[rows, heads, head_dim]` fp32 (rows may be strided: a view of the fused q/k rows); the caches
    `[pages, page_size, kv_heads, head_dim]` fp32, contiguous; page_table int32 `[rows, >= pages]`
    with a contiguous last dim; seq_lens int64 `[rows]` contiguous, each in 1..max_seq_len (checked, as
    are the page ids, before anything is read).
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError("the native CPU paged decode attention could not be built")
    rows, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if (q.dtype, k_cache.dtype, v_cache.dtype, page_table.dtype, seq_lens.dtype) != (
            torch.float32, torch.float32, torch.float32, torch.int32, torch.int64):
        raise TypeError("fp32 q and caches, an int32 page table and int64 lengths")
    if q.stride(2) != 1 or q.stride(1) != head_dim or page_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("q rows, page table rows and lengths must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("contiguous K and V caches of one shape")
    if page_table.shape[0] != rows or seq_lens.shape != (rows,) or page_table.shape[1] * page_size < max_seq_len:
        raise ValueError("a page table row and a length per q row, the table wide enough for max_seq_len")
    out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
    scratch = torch.empty(heads // kv_heads * (-(-max_seq_len // 8) * 8), dtype=torch.float32)
    status = lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], page_table.data_ptr(),
        page_table.stride(0), seq_lens.data_ptr(), rows, max_seq_len, heads, kv_heads, head_dim, page_size, scale,
        scratch.data_ptr(), out.data_ptr(),
    )
    if status != 0:
        raise ValueError({
            -1: f"unsupported head shapes: {heads} heads, {kv_heads} kv heads, head_dim {head_dim}",
            -2: f"a sequence length outside 1..{max_seq_len}",
            -3: "a page id outside the KV pool",
        }[status])
    return out
