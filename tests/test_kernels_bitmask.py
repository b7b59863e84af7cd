"""`sampling.bitmask` (grammar masks): the Triton kernel against the torch reference, on the CPU under
Triton's interpreter (the GPU run is `test_kernels_bitmask_gpu.py`), and the reference against a plain
loop over the bits."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.registry import select_kernel
from tokenspeed.kernels.sampling.bitmask_reference import allowed_tokens, apply_bitmask_reference
from tokenspeed.kernels.sampling.bitmask_triton import apply_bitmask_triton

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


def random_case(rows: int, vocab: int, masked: list[int], seed: int = 0, words: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator)
    words = words if words is not None else (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(masked), words), generator=generator, dtype=torch.int32)
    return logits, bitmask, torch.tensor(masked, dtype=torch.int64)


def test_reference_follows_the_bits():
    logits, bitmask, indices = random_case(3, 70, [2, 0], words=2)  # 64 bits for 70 tokens: the last 6 forbidden
    out = logits.clone()
    apply_bitmask_reference(out, bitmask, indices)
    for entry, row in enumerate(indices.tolist()):
        for token in range(70):
            word, bit = divmod(token, 32)
            allowed = word < 2 and (int(bitmask[entry, word]) >> bit) & 1
            assert out[row, token] == (logits[row, token] if allowed else float("-inf"))
    assert torch.equal(out[1], logits[1])  # an unmasked row is untouched
    assert allowed_tokens(bitmask, 70).shape == (2, 70)


@interpreted
@pytest.mark.parametrize("rows, vocab, masked", [(4, 100, [3, 1]), (2, 2500, [0, 1]), (3, 64, []), (1, 33, [0])])
def test_triton_matches_reference(rows, vocab, masked):
    logits, bitmask, indices = random_case(rows, vocab, masked, seed=vocab)
    expected, got = logits.clone(), logits.clone()
    apply_bitmask_reference(expected, bitmask, indices)
    apply_bitmask_triton(got, bitmask, indices)
    assert torch.equal(expected, got)


def test_registry_serves_the_reference_on_cpu_and_triton_on_cuda():
    assert select_kernel("sampling", "bitmask", platform="cpu").name == "reference"
    assert select_kernel("sampling", "bitmask", platform="cuda").name == "triton"
