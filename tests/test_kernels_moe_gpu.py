"""MoE kernels against their torch references on a CUDA GPU, at serving shapes (`make test-gpu`).

Shapes are Moonlight-16B-A3B's experts (hidden 2048, intermediate 1408, 64
experts, top-6) and Qwen3-30B-A3B's (2048, 768, 128 experts, top-8), in bf16,
for 1, 7, 64 and 1000 tokens (decode, ragged, the decode/medium tile switch,
prefill with experts of very different loads). bf16 kernels and the bf16
reference round differently, so beyond a plain closeness check each kernel's
error against an fp32 oracle must stay within a small factor of the bf16
reference's own. Both kernels are also captured in a CUDA graph and replayed
with new routing, since that is how the executor runs decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tokenspeed.kernels.moe.experts_grouped_mm import GROUPED_MM_AVAILABLE, fused_experts_grouped_mm  # noqa: E402
from tokenspeed.kernels.moe.experts_reference import fused_experts_reference  # noqa: E402
from tokenspeed.kernels.moe.routing_reference import route_reference  # noqa: E402

pytest.importorskip("triton")

from tokenspeed.kernels.moe.align import align_by_expert  # noqa: E402
from tokenspeed.kernels.moe.align_triton import ALIGN_TRITON_MAX_PAIRS, align_by_expert_triton  # noqa: E402
from tokenspeed.kernels.moe.experts_triton import fused_experts_triton  # noqa: E402
from tokenspeed.kernels.moe.routing_triton import route_triton  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {"moonlight": (2048, 1408, 64, 6), "qwen3_30b_a3b": (2048, 768, 128, 8)}
Kernel = Callable[..., torch.Tensor]
KERNELS: dict[str, Kernel] = {"triton": fused_experts_triton}
if GROUPED_MM_AVAILABLE:
    KERNELS["grouped_mm"] = fused_experts_grouped_mm


def _weights(shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, inter, experts, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5
    return w13.to(BF16), w2.to(BF16)


def _batch(shape: str, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 activations and a sigmoid/renormalised routing skewed so expert loads differ."""
    hidden, _, experts, top_k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(BF16)
    skew = torch.linspace(0, 2, experts, device="cuda")
    logits = torch.randn(tokens, experts, generator=gen, device="cuda") + skew
    weights, ids = route_reference(logits, top_k=top_k, scoring="sigmoid", renormalize=True)
    return x, weights, ids


@pytest.fixture(scope="module", params=sorted(SHAPES))
def expert_weights(request: pytest.FixtureRequest) -> tuple[str, torch.Tensor, torch.Tensor]:
    return request.param, *_weights(request.param, seed=0)


@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_experts_match_reference_in_bf16(
    expert_weights: tuple[str, torch.Tensor, torch.Tensor], kernel: str, tokens: int
) -> None:
    shape, w13, w2 = expert_weights
    x, weights, ids = _batch(shape, tokens, seed=tokens)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    exact = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    out = KERNELS[kernel](x, w13, w2, weights, ids)
    assert out.dtype == BF16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    kernel_error = (out.float() - exact).abs().mean().item()
    reference_error = (expected.float() - exact).abs().mean().item()
    assert kernel_error <= 1.5 * reference_error + 1e-4, (kernel_error, reference_error)


ROUTERS: dict[
    str, tuple[int, dict[str, Any]]
] = {  # experts, routing arguments (correction bias added for sigmoid scoring)
    "qwen3_30b_a3b": (128, dict(top_k=8, scoring="softmax", renormalize=True)),
    "moonlight": (64, dict(top_k=6, scoring="sigmoid", renormalize=True, num_groups=1, topk_groups=1)),
    "deepseek_v3": (256, dict(top_k=8, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4)),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_triton_route_matches_reference(router: str) -> None:
    experts, args = ROUTERS[router]
    args = dict(args)
    gen = torch.Generator(device="cuda").manual_seed(experts)
    if args["scoring"] == "sigmoid":
        args |= dict(group_scoring="top2_sum", routed_scaling_factor=2.5)
        args["correction_bias"] = torch.rand(experts, generator=gen, device="cuda")
    # fp32 logits: bf16 ones tie often, and the kernels may order ties differently
    logits = torch.randn(1000, experts, generator=gen, device="cuda")
    want_w, want_ids = route_reference(logits, **args)
    got_w, got_ids = route_triton(logits, **args)
    want_order, got_order = want_ids.long().argsort(-1), got_ids.long().argsort(-1)
    want_ids, got_ids = want_ids.long().gather(1, want_order), got_ids.long().gather(1, got_order)
    same = (want_ids == got_ids).all(dim=-1)
    assert same.float().mean().item() >= 0.99  # a rare near-tie may flip in the last ulp
    torch.testing.assert_close(
        got_w.gather(1, got_order)[same], want_w.gather(1, want_order)[same], rtol=1e-5, atol=1e-6
    )


def test_route_on_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(257, 64, generator=gen)
    bias = torch.rand(64, generator=gen)
    args = dict(top_k=6, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=3)
    args |= dict(group_scoring="top2_sum", routed_scaling_factor=2.446)
    cpu_w, cpu_ids = route_reference(logits, correction_bias=bias, **args)  # type: ignore[arg-type]
    gpu_w, gpu_ids = route_reference(logits.cuda(), correction_bias=bias.cuda(), **args)  # type: ignore[arg-type]
    cpu_order, gpu_order = cpu_ids.long().argsort(-1), gpu_ids.long().argsort(-1)
    assert torch.equal(cpu_ids.long().gather(1, cpu_order), gpu_ids.long().cpu().gather(1, gpu_order.cpu()))
    torch.testing.assert_close(cpu_w.gather(1, cpu_order), gpu_w.cpu().gather(1, gpu_order.cpu()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_triton_align_equals_torch_align(shape: str) -> None:
    _, _, experts, top_k = SHAPES[shape]
    for tokens in (1, 3, 64, ALIGN_TRITON_MAX_PAIRS // top_k):
        _, _, ids = _batch(shape, tokens, seed=tokens)
        for block_m in (16, 64):
            expected = align_by_expert(ids, experts, block_m)
            got = align_by_expert_triton(ids, experts, block_m)
            assert torch.equal(got.pair_ids, expected.pair_ids), (tokens, block_m)
            assert torch.equal(got.block_expert, expected.block_expert), (tokens, block_m)


@pytest.mark.parametrize("tokens", [7, 200])  # 200 * 8 pairs: the torch alignment
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_experts_replay_in_a_cuda_graph_with_new_routing(kernel: str, tokens: int) -> None:
    shape = "qwen3_30b_a3b"
    w13, w2 = _weights(shape, seed=1)
    x, weights, ids = _batch(shape, tokens, seed=7)
    fn = KERNELS[kernel]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, w13, w2, weights, ids)  # warm up: compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w13, w2, weights, ids)
    for seed in (8, 9):
        new_x, new_weights, new_ids = _batch(shape, tokens, seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        expected = fused_experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_triton_router_logits_match_cublas(shape: str, tokens: int) -> None:
    """The one-launch router logits (`moe.router_logits`) at serving shapes against `F.linear` on fp32 x."""
    from tokenspeed.kernels.moe.router_logits_triton import router_logits_triton
    from tokenspeed.kernels.moe.routing_reference import router_logits_reference

    hidden, _, experts, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(BF16)
    weight = torch.randn(experts, hidden, generator=gen, device="cuda") * hidden**-0.5
    torch.testing.assert_close(router_logits_triton(x, weight), router_logits_reference(x, weight),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 64])
def test_triton_pair_sum_matches_torch(tokens: int) -> None:
    """`experts_triton.sum_pairs` (fp32 sum in k order, rounded once) against torch's bf16 k-sum."""
    from tokenspeed.kernels.moe.experts_triton import sum_pairs

    pairs = torch.randn(tokens * 8, 2048, device="cuda").to(BF16)
    want = pairs.view(tokens, 8, 2048).sum(dim=1)
    got = sum_pairs(pairs, tokens, 8)
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)  # summation order: 1 bf16 ulp
