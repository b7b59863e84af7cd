"""`comm.fused_allreduce_rmsnorm` on a CUDA GPU (`make test-gpu`): world size 1 and simulated worlds.

One GPU stands in for N: the N addends are the slices of a stacked
`[world, tokens, hidden]` bf16 tensor, which the kernel reads through the same
per-peer pointer arguments it would take for peers' symmetric-memory buffers.
A call does no host-to-device work, so it captures in a CUDA graph. Shapes are
Llama-3.1-8B's (hidden 4096) and DeepSeek-V3's (7168, not a power of two),
from one decode token to a prefill chunk.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

pytest.importorskip("triton")

from tests.paged_kernels import capture_cuda_graph  # noqa: E402
from tokenspeed.kernels.comm.fused_allreduce_rmsnorm_triton import fused_allreduce_rmsnorm_triton  # noqa: E402
from tokenspeed.kernels.comm.partial_sums import PartialSums  # noqa: E402
from tokenspeed.kernels.comm.reference import fused_allreduce_rmsnorm_reference  # noqa: E402
from tokenspeed.placement.collectives import select_fused_allreduce_rmsnorm  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("rows", [1, 7, 512])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fused_allreduce_rmsnorm_bf16(hidden: int, rows: int, world: int) -> None:
    gen = torch.Generator().manual_seed(hidden + rows + world)
    stacked = torch.randn(world, rows, hidden, generator=gen).to(BF16).cuda()
    residual = torch.randn(rows, hidden, generator=gen).to(BF16).cuda()
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(BF16).cuda()
    for res in (residual, None):
        partials = PartialSums(stacked[0]) if world == 1 else PartialSums.simulated(stacked, world - 1)
        normed, summed = fused_allreduce_rmsnorm_triton(partials, weight, 1e-5, res)
        ref_normed, ref_summed = fused_allreduce_rmsnorm_reference(partials, weight, 1e-5, res)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(normed, ref_normed)


def test_fused_allreduce_rmsnorm_replays_in_a_cuda_graph() -> None:
    stacked = torch.zeros(4, 16, 4096, dtype=BF16, device="cuda")
    residual = torch.zeros(16, 4096, dtype=BF16, device="cuda")
    weight = torch.rand(4096, device="cuda").to(BF16) + 0.5
    partials = PartialSums.simulated(stacked, 2)
    graph, (normed, summed) = capture_cuda_graph(
        lambda: fused_allreduce_rmsnorm_triton(partials, weight, 1e-5, residual)
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        stacked.copy_(torch.randn(stacked.shape, device="cuda", generator=gen))
        residual.copy_(torch.randn(residual.shape, device="cuda", generator=gen))
        graph.replay()
        ref_normed, ref_summed = fused_allreduce_rmsnorm_reference(partials, weight, 1e-5, residual)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(normed, ref_normed)


def test_the_registry_gives_the_triton_kernel_for_peer_buffers() -> None:
    assert select_fused_allreduce_rmsnorm("cuda", BF16, "peer_buffers").name == "triton"
