"""`comm.fused_allreduce_rmsnorm`: the Triton kernel against the reference on the CPU (Triton interpreter),
the reference against its definition, and the registry's choice by transport.

World sizes 1-4 are simulated with a stacked tensor of addends, as on one GPU
(`PartialSums.simulated`); the reference over a real gloo group is in
`test_placement_distributed.py`. The interpreter mishandles bf16, so dtypes
are fp32 and fp16 here; bf16 runs in `test_kernels_comm_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.comm.fused_allreduce_rmsnorm_triton import fused_allreduce_rmsnorm_triton
from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.comm.reference import fused_allreduce_rmsnorm_reference
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference
from tokenspeed.kernels.registry import Band, describe_selection
from tokenspeed.placement.collectives import select_fused_allreduce_rmsnorm

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def _case(world: int, rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    stacked = torch.randn(world, rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    return stacked, weight, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_is_the_sum_then_the_residual_norm(dtype: torch.dtype) -> None:
    stacked, weight, residual = _case(3, 5, 48, dtype)
    total = stacked.float().sum(0).to(dtype)
    normed, summed = fused_allreduce_rmsnorm_reference(PartialSums.simulated(stacked, 1), weight, 1e-6, residual)
    want_normed, want_summed = rms_norm_reference(total, weight, 1e-6, residual)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, rtol=0, atol=TOL[dtype])
    normed, summed = fused_allreduce_rmsnorm_reference(PartialSums.simulated(stacked), weight, 1e-6)
    assert torch.equal(summed, total)  # no residual: the sum becomes the residual stream
    torch.testing.assert_close(normed, rms_norm_reference(total, weight, 1e-6), rtol=0, atol=TOL[dtype])
    alone = stacked[0].clone()  # world size 1: no peers, no group, no collective
    normed, summed = fused_allreduce_rmsnorm_reference(PartialSums(alone), weight, 1e-6)
    assert summed is alone and torch.equal(normed, rms_norm_reference(alone, weight, 1e-6))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (5, 48), (3, 200)])
def test_triton_matches_reference(dtype: torch.dtype, world: int, rows: int, hidden: int) -> None:
    stacked, weight, residual = _case(world, rows, hidden, dtype, seed=world * 10 + rows)
    for res in (residual, None):
        for rank in range(world):  # every rank reduces the same peers to the same result
            got = fused_allreduce_rmsnorm_triton(PartialSums.simulated(stacked, rank), weight, 1e-6, res)
            want = fused_allreduce_rmsnorm_reference(PartialSums.simulated(stacked, rank), weight, 1e-6, res)
            assert torch.equal(got[1], want[1])  # the same fp32 sums in the same order, rounded once
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=TOL[dtype])


@interpreted
def test_triton_at_world_size_one_reads_its_own_addend_and_handles_no_rows() -> None:
    stacked, weight, residual = _case(1, 4, 32, torch.float32)
    got = fused_allreduce_rmsnorm_triton(PartialSums(stacked[0]), weight, 1e-6, residual)
    want = rms_norm_reference(stacked[0], weight, 1e-6, residual)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    empty = torch.empty(0, 32)
    normed, summed = fused_allreduce_rmsnorm_triton(PartialSums.simulated(torch.stack([empty, empty])), weight, 1e-6)
    assert normed.shape == summed.shape == (0, 32)


@interpreted
def test_triton_refuses_mismatched_peers() -> None:
    weight = torch.ones(8)
    with pytest.raises(ValueError, match="same shape"):
        fused_allreduce_rmsnorm_triton(PartialSums(torch.ones(2, 8), peers=(torch.ones(2, 8), torch.ones(3, 8))), weight, 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        fused_allreduce_rmsnorm_triton(PartialSums.simulated(torch.ones(2, 8, 4).transpose(1, 2)), torch.ones(8), 1e-6)


def test_the_registry_picks_by_transport() -> None:
    on_gpu = describe_selection(
        "comm", "fused_allreduce_rmsnorm", platform="cuda", dtype=torch.bfloat16, traits={"transport": "peer_buffers"}
    )
    assert on_gpu.chosen == "triton"
    nccl = describe_selection(
        "comm", "fused_allreduce_rmsnorm", platform="cuda", dtype=torch.bfloat16, traits={"transport": "process_group"}
    )
    assert nccl.chosen == "reference" and "transport" in str(nccl)
    assert select_fused_allreduce_rmsnorm("cpu", torch.float32).band == Band.REFERENCE
