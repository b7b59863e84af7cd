"""Causal attention of a prompt chunk over its row's KV pages on the CPU (`native/paged_prefill_cpu.c`, via ctypes).

Why: prompt chunks in the CPU forward (`executor/cpu_decode.py`) attended through torch's flash SDPA in
64-query blocks with additive masks and K/V repeated for GQA (2.70 ms a layer on a causal 512-token row
of the embedded model: 8 heads over 2, head_dim 32, one thread), or, one token per row, through the
paged decode kernel (2.50 ms: a horizontal sum per query and key). This kernel reads the row's pages in
place, transposes its keys once per kv head and scores tiles of 8 (token, head) rows against 16 keys at
a time as a small register-blocked GEMM, skipping the keys a tile's last token cannot see: 1.75 ms at
512, 0.16 against 0.30 (SDPA) at 128, 7.0 against 9.9 at 1024 (`benchmarks/results/cpu/cpu_fused_ops.md`).
It sums in another order than SDPA, so it equals it within fp32 rounding (tested to 1e-5), not bit for bit.

Built on first use with the system C compiler (`native_build.py`, cached); where none works it is
unavailable (logged once) and the caller keeps SDPA. It runs under the native paged attention's switch
(`--disable-cpu-paged-attention`, `TOKENSPEED_CPU_ATTENTION_NATIVE=0`).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tokenspeed.kernels.native_build import NativeLibrary, load_vector_library

logger = logging.getLogger("tokenspeed.kernels")

_SOURCE = Path(__file__).parent / "native" / "paged_prefill_cpu.c"
HEAD_DIMS = (16, 32, 64, 128)  # what the C kernel takes
_TILE = 8  # the C kernel's TILE: scratch rows of scores


def _load() -> ctypes.CDLL:
    lib = load_vector_library(_SOURCE, "paged_prefill_cpu")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_prefill_attention
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, i64]
    fn.restype = ctypes.c_int
    return lib


NATIVE = NativeLibrary(_load, logger, "native CPU paged prefill attention unavailable; prompt rows keep SDPA")


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source version and CPU), or None where it cannot be built."""
    return NATIVE.get()


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim in HEAD_DIMS and num_kv_heads > 0 and num_heads % num_kv_heads == 0


class PagedPrefillRow:
    """One prompt chunk of a step as the kernel reads it, checked once and called by every layer: its `n`
    tokens at positions `first .. first + n - 1`, each attending positions 0 up to its own, on the row's
    pages (int32, contiguous, covering `first + n` positions)."""

    __slots__ = ("_lib", "_pages", "first", "n", "heads", "kv_heads", "head_dim", "page_size", "_scratch")

    def __init__(self, pages: torch.Tensor, first: int, n: int, *, heads: int, kv_heads: int, head_dim: int,
                 page_size: int) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("the native CPU paged prefill attention could not be built")
        if not supports(heads, kv_heads, head_dim):
            raise ValueError(f"unsupported head shapes: {heads} heads, {kv_heads} kv heads, head_dim {head_dim}")
        if pages.dtype != torch.int32 or pages.dim() != 1 or pages.stride(0) != 1:
            raise ValueError("the row's pages must be contiguous int32")
        if first < 0 or n < 1 or pages.shape[0] * page_size < first + n:
            raise ValueError(f"{pages.shape[0]} pages do not cover positions 0..{first + n - 1}")
        self._lib, self._pages = lib, pages  # kept alive while the kernel reads them
        self.first, self.n, self.heads, self.kv_heads, self.head_dim = first, n, heads, kv_heads, head_dim
        self.page_size = page_size
        padded = -(-(first + n) // 16) * 16
        self._scratch = torch.empty((2 * head_dim + _TILE) * padded, dtype=torch.float32)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        """Writes the chunk's attention into `out`; q and out `[n, heads, head_dim]` fp32 with contiguous
        heads (rows may be strided); the caches `[pages, page_size, kv_heads, head_dim]` fp32, contiguous."""
        shape = (self.n, self.heads, self.head_dim)
        for name, t in (("q", q), ("out", out)):
            if t.dtype != torch.float32 or t.shape != shape or t.stride(2) != 1 or t.stride(1) != self.head_dim:
                raise ValueError(f"{name} must be fp32 {list(shape)} with contiguous heads")
        expected = (self.page_size, self.kv_heads, self.head_dim)
        if (k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32 or k_cache.shape[1:] != expected
                or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise ValueError(f"contiguous fp32 K and V caches of one shape [pages, {', '.join(map(str, expected))}]")
        status = self._lib.paged_prefill_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
            self._pages.data_ptr(), self.first, self.n, self.heads, self.kv_heads, self.head_dim, self.page_size,
            scale, self._scratch.data_ptr(), out.data_ptr(), out.stride(0),
        )
        if status != 0:
            raise ValueError({-1: "unsupported head shapes", -3: "a page id outside the KV pool"}[status])
