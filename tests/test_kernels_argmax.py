"""The greedy draw's Triton argmax (`kernels/sampling/argmax_triton.py`) on the CPU, under Triton's interpreter,
against torch.argmax and the REFERENCE kernel: first maximum across and within chunks, NaN, rows of -inf, a
short last chunk, one-chunk rows, bf16 logits; and the sampler's off switch."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels import arrival_counters, scoped_kernel_overrides
from tokenspeed.kernels.sampling.argmax_triton import CHUNK, argmax_triton
from tokenspeed.kernels.sampling.reference import argmax_reference

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


def _rows(vocab: int) -> torch.Tensor:
    """Rows that each test one rule of the first maximum, with random others."""
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    last = vocab - 1
    logits[1, [min(CHUNK + 5, last - 1), last]] = 9.0  # a tie across chunks (where two): the earlier
    logits[2, [7, 3]] = 9.0  # a tie within a chunk: the earlier position
    logits[3, last] = 9.0  # the maximum in the short last chunk
    logits[4] = float("-inf")  # nothing allowed: the first position, as torch.argmax
    logits[5, [2, last]] = float("nan")  # NaN above everything, the first NaN wins
    logits[5, 1] = float("inf")
    logits[6, min(CHUNK + 9, last)] = float("nan")
    logits[6, 0] = float("inf")
    logits[7, :] = 0.5  # all equal: the first
    return logits


@interpreted
@pytest.mark.parametrize("vocab", [3 * CHUNK + 17, 2 * CHUNK, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_the_first_maximum_of_each_row(vocab: int, dtype: torch.dtype) -> None:
    logits = _rows(vocab).to(dtype)
    want = torch.argmax(logits.float(), dim=-1)
    got = argmax_triton(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(argmax_reference(logits), want)
    assert arrival_counters.all_at_rest()  # every row's last program reset its counter
    assert argmax_triton(logits[:0]).shape == (0,)


@interpreted
def test_argmax_reads_strided_rows() -> None:
    wide = _rows(2 * CHUNK + 3)
    view = wide[:, 1:]  # rows not starting at a chunk boundary of the storage, last stride 1
    assert torch.equal(argmax_triton(view), torch.argmax(view, dim=-1))
    transposed = wide.t().contiguous().t()  # columns contiguous: copied first
    assert torch.equal(argmax_triton(transposed), torch.argmax(wide, dim=-1))


def test_sampler_greedy_draw_honours_the_argmax_override() -> None:
    """The engine builds its sampler under its kernel overrides (`--kernel sampling.argmax=...`), so the sampler
    must choose its kernels when built: an override that cannot serve the device fails there (the CPU has only
    the reference, so the second block is what tells a lazy choice, made after the overrides' scope, apart)."""
    from tokenspeed.executor.sampler import Sampler
    from tokenspeed.kernels.registry import KernelSelectionError

    with scoped_kernel_overrides([("sampling", "argmax", "reference")]):
        sampler = Sampler(torch.device("cpu"))
    logits = _rows(300)
    assert torch.equal(sampler.argmax(logits), torch.argmax(logits, dim=-1))
    with pytest.raises(KernelSelectionError), scoped_kernel_overrides([("sampling", "argmax", "triton")]):
        Sampler(torch.device("cpu"))  # the Triton kernel serves CUDA devices only
