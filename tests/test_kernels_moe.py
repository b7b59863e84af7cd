"""MoE kernels: the torch references against transformers' routers and expert loop,
and the Triton fused-MoE kernel against the reference under Triton's interpreter.

The references are the oracle for every fast MoE kernel and for the MoE model
parity tests, so they are checked against the transformers modules themselves
(built from tiny configs, with the same random weights), for each routing
variant: Qwen3-MoE (with and without norm_topk_prob), Mixtral, DeepSeek-V2
greedy and group_limited_greedy, DeepSeek-V3 noaux_tc. Inputs are continuous
random values, so ties (where top-k order is implementation-defined) do not occur.

Triton chooses between interpreting and compiling when `triton.language` is
first imported, so, through `tests/triton_interpreter.py`, this module sets
TRITON_INTERPRET=1 before anything imports triton and reruns its Triton tests
in a fresh process when triton was already loaded in compiled mode. The
interpreter mishandles bf16, so those tests use tiny fp32/fp16 shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)

# isort: split
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from tokenspeed.kernels.moe import ROUTER_TRITON_MAX_TOKENS, experts_triton
from tokenspeed.kernels.moe.align import align_by_expert, max_blocks, sort_by_expert
from tokenspeed.kernels.moe.align_triton import ALIGN_TRITON_MAX_PAIRS, align_by_expert_triton
from tokenspeed.kernels.moe.experts_dispatch import select_experts_by_batch
from tokenspeed.kernels.moe.experts_grouped_mm import (
    GROUPED_MM_AVAILABLE,
    GROUPED_MM_MIN_TOKENS,
    fused_experts_grouped_mm,
)
from tokenspeed.kernels.moe.experts_reference import fused_experts_reference
from tokenspeed.kernels.moe.experts_triton import (
    DECODE_TILES,
    MEDIUM_TILES,
    PREFILL_TILES,
    TileConfig,
    fused_experts_triton,
    tile_config,
)
from tokenspeed.kernels.moe.router_logits_triton import router_logits_triton
from tokenspeed.kernels.moe.routing_reference import route_reference, router_logits_reference
from tokenspeed.kernels.moe.routing_triton import route_triton
from tokenspeed.kernels.registry import select_kernel, set_kernel_override

needs_grouped_mm = pytest.mark.skipif(not GROUPED_MM_AVAILABLE, reason="this torch has no grouped_mm")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}  # rtol and atol
# Small tiles keep the interpreter fast and make the tiny shapes span several row blocks and K/N tiles.
TINY_TILES = TileConfig(
    block_m=16, block_n_up=16, block_n_down=16, block_k=16, num_warps=4, num_stages=1, group_m=2
)

HIDDEN = 32
TOKENS = 37


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows reordered by expert id, so kernels that order the k columns differently compare equal."""
    ids = ids.long()
    order = ids.argsort(dim=-1)
    return weights.float().gather(1, order), ids.gather(1, order)


def _hf_route(router: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(
                torch.rand(router.e_score_correction_bias.shape, generator=gen)
            )
        hidden = torch.randn(TOKENS, HIDDEN, generator=gen) * 0.3
        logits, weights, ids = router(hidden)
    return logits, weights, ids


def _assert_same_routing(ours: tuple[torch.Tensor, torch.Tensor], hf_weights: Any, hf_ids: Any) -> None:
    weights, ids = ours
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    got_w, got_ids = _by_id(weights, ids)
    want_w, want_ids = _by_id(hf_weights, hf_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_matches_qwen3_moe(norm_topk_prob: bool) -> None:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    logits, hf_w, hf_ids = _hf_route(Qwen3MoeTopKRouter(config), seed=1)
    ours = route_reference(logits, top_k=4, scoring="softmax", renormalize=norm_topk_prob)
    _assert_same_routing(ours, hf_w, hf_ids)
    if norm_topk_prob:
        torch.testing.assert_close(ours[0].sum(-1), torch.ones(TOKENS))
    else:
        assert bool((ours[0].sum(-1) < 1).all())


def test_route_matches_mixtral() -> None:
    config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    logits, hf_w, hf_ids = _hf_route(MixtralTopKRouter(config), seed=2)
    _assert_same_routing(route_reference(logits, top_k=2, scoring="softmax", renormalize=True), hf_w, hf_ids)


@pytest.mark.parametrize(("method", "groups", "kept"), [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_route_matches_deepseek_v2(method: str, groups: int, kept: int) -> None:
    config = DeepseekV2Config(
        hidden_size=HIDDEN,
        n_routed_experts=16,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=groups,
        topk_group=kept,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,  # ignored by transformers' V2 router; the reference follows it
    )
    logits, hf_w, hf_ids = _hf_route(DeepseekV2TopkRouter(config), seed=3)
    ours = route_reference(
        logits,
        top_k=3,
        scoring="softmax",
        renormalize=False,
        num_groups=groups if method != "greedy" else None,
        topk_groups=kept if method != "greedy" else None,
        group_scoring="max",
        routed_scaling_factor=1.7,
    )
    _assert_same_routing(ours, hf_w, hf_ids)
    if method == "group_limited_greedy":
        row_groups = [len(set((row // 4).tolist())) for row in ours[1].long()]
        assert max(row_groups) <= kept
        assert (ours[1].long() // 4).unique().numel() > kept  # different tokens keep different groups


@pytest.mark.parametrize(
    ("groups", "kept", "norm", "scale"), [(4, 2, True, 2.5), (1, 1, True, 2.446), (8, 3, False, 1.0)]
)
def test_route_matches_deepseek_v3_noaux_tc(groups: int, kept: int, norm: bool, scale: float) -> None:
    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=32,
        num_experts_per_tok=6,
        n_group=groups,
        topk_group=kept,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = DeepseekV3TopkRouter(config)
    logits, hf_w, hf_ids = _hf_route(router, seed=4 + groups)
    ours = route_reference(
        logits,
        top_k=6,
        scoring="sigmoid",
        renormalize=norm,
        num_groups=groups,
        topk_groups=kept,
        group_scoring="top2_sum",
        correction_bias=router.e_score_correction_bias,
        routed_scaling_factor=scale,
    )
    _assert_same_routing(ours, hf_w, hf_ids)
    ids = ours[1].long()
    per_row_groups = [len(set((row // (32 // groups)).tolist())) for row in ids]
    assert max(per_row_groups) <= kept


def test_route_bias_chooses_but_does_not_weigh() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    weights, ids = route_reference(
        logits, top_k=2, scoring="sigmoid", renormalize=False, correction_bias=bias
    )
    got_w, got_ids = _by_id(weights, ids)
    assert got_ids.tolist() == [[0, 3]]
    torch.testing.assert_close(got_w, torch.sigmoid(torch.tensor([[0.0, 3.0]])))


def test_route_group_limit_hand_example() -> None:
    # groups {0,1} {2,3} {4,5}; group maxima 0.9, 0.8, 0.95 -> keep groups 0 and 2 with topk_groups=2
    probs = torch.tensor([[0.9, 0.05, 0.8, 0.7, 0.95, 0.6]])
    weights, ids = route_reference(
        probs.log(),
        top_k=3,
        scoring="softmax",
        renormalize=True,
        num_groups=3,
        topk_groups=2,
        group_scoring="max",
    )
    got_w, got_ids = _by_id(weights, ids)
    assert got_ids.tolist() == [[0, 4, 5]]
    torch.testing.assert_close(got_w, torch.tensor([[0.9, 0.95, 0.6]]) / 2.45)


def test_route_accepts_half_logits_and_rejects_bad_configs() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    full = route_reference(logits, top_k=2, scoring="softmax", renormalize=True)
    half = route_reference(logits.to(torch.bfloat16), top_k=2, scoring="softmax", renormalize=True)
    assert half[0].dtype == torch.float32 and half[1].shape == (5, 2)
    torch.testing.assert_close(half[0].sum(-1), full[0].sum(-1))
    for bad in (
        dict(top_k=2, scoring="relu", renormalize=True),
        dict(top_k=9, scoring="softmax", renormalize=True),
        dict(top_k=2, scoring="softmax", renormalize=True, num_groups=3),
        dict(top_k=2, scoring="softmax", renormalize=True, num_groups=4, topk_groups=5),
        dict(top_k=5, scoring="softmax", renormalize=True, num_groups=4, topk_groups=2),
        dict(top_k=2, scoring="softmax", renormalize=True, num_groups=2, group_scoring="mean"),
    ):
        with pytest.raises(ValueError):
            route_reference(logits, **bad)  # type: ignore[arg-type]


def _experts_case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """Random activations, expert weights and a softmax routing (distinct ids per token)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route_reference(logits, top_k=top_k, scoring="softmax", renormalize=True)
    return x, w13, w2, weights, ids


def test_experts_reference_matches_transformers_loop() -> None:
    experts, inter, top_k = 8, 24, 3
    x, w13, w2, weights, ids = _experts_case(TOKENS, HIDDEN, inter, experts, top_k, torch.float32, seed=5)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts, moe_intermediate_size=inter)
    config._experts_implementation = "eager"
    hf = Qwen3MoeExperts(config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        expected = hf(x, ids.long(), weights)
    out = fused_experts_reference(x, w13, w2, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_experts_reference_is_the_weighted_sum_of_swiglu_experts() -> None:
    x, w13, w2, weights, ids = _experts_case(6, 16, 8, 5, 2, torch.float64, seed=6)
    expected = torch.zeros_like(x)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = w13[e, :8] @ x[t], w13[e, 8:] @ x[t]
            expected[t] += float(weights[t, k]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_experts_reference(x, w13, w2, weights, ids), expected)


def test_experts_reference_bf16_accumulates_in_fp32() -> None:
    x, w13, w2, weights, ids = _experts_case(9, 64, 32, 6, 4, torch.bfloat16, seed=7)
    out = fused_experts_reference(x, w13, w2, weights, ids)
    exact = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, rtol=3e-2, atol=3e-2)


def test_experts_reference_handles_no_tokens_and_bad_shapes() -> None:
    x, w13, w2, weights, ids = _experts_case(0, 16, 8, 4, 2, torch.float32, seed=8)
    assert fused_experts_reference(x, w13, w2, weights, ids).shape == (0, 16)
    x, w13, w2, weights, ids = _experts_case(3, 16, 8, 4, 2, torch.float32, seed=8)
    with pytest.raises(ValueError):
        fused_experts_reference(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError):
        fused_experts_reference(x, w13, w2, weights[:, :1], ids)


def test_registry_serves_the_references_on_cpu() -> None:
    assert select_kernel("moe", "route", platform="cpu").impl is route_reference
    assert select_kernel("moe", "router_logits", platform="cpu").impl is router_logits_reference
    assert (
        select_kernel("moe", "experts", platform="cpu", dtype=torch.float32).impl is fused_experts_reference
    )


test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, "-k", "triton", slow=True)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"), [(7, 2, 6, 4), (1, 3, 8, 16), (40, 4, 5, 16)]
)
def test_align_places_every_pair_once_in_its_experts_blocks(
    tokens: int, top_k: int, experts: int, block_m: int
) -> None:
    _, _, _, _, ids = _experts_case(tokens, 8, 8, experts, top_k, torch.float32, seed=tokens)
    aligned = align_by_expert(ids, experts, block_m)
    pairs = tokens * top_k
    assert aligned.num_blocks == max_blocks(pairs, experts, block_m)
    blocks = aligned.pair_ids.view(-1, block_m).long()
    real = blocks < pairs
    assert sorted(blocks[real].tolist()) == list(range(pairs))
    flat_ids = ids.reshape(-1).long()
    for b, expert in enumerate(aligned.block_expert.tolist()):
        if expert < 0:
            assert not bool(real[b].any())
        else:
            assert bool(real[b, 0])  # no block is all padding
            assert set(flat_ids[blocks[b][real[b]]].tolist()) == {expert}
    used = aligned.block_expert[aligned.block_expert >= 0]
    assert bool((used[1:] >= used[:-1]).all())  # blocks run through the experts in order
    grouped = sort_by_expert(ids, experts)
    assert grouped.counts.tolist() == torch.bincount(flat_ids, minlength=experts).tolist()


def test_triton_tile_config_follows_pairs_per_expert() -> None:
    assert tile_config(1, 8, 128) is DECODE_TILES
    assert tile_config(64, 6, 64) is DECODE_TILES
    assert tile_config(512, 8, 128) is MEDIUM_TILES
    assert tile_config(4096, 8, 128) is PREFILL_TILES


@interpreted
@pytest.mark.parametrize(
    ("dtype", "tokens", "top_k", "experts"),
    [(torch.float32, 1, 2, 4), (torch.float32, 7, 3, 6), (torch.float16, 7, 3, 6), (torch.float16, 33, 2, 3)],
)
def test_triton_experts_match_reference(dtype: torch.dtype, tokens: int, top_k: int, experts: int) -> None:
    # hidden 48 and intermediate 40 are not multiples of the 16-wide tiles: K and N edges are masked
    x, w13, w2, weights, ids = _experts_case(tokens, 48, 40, experts, top_k, dtype, seed=tokens + top_k)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    out = fused_experts_triton(x, w13, w2, weights, ids, tiles=TINY_TILES)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@interpreted
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 8, 128, 16), (7, 2, 6, 4), (64, 6, 64, 16), (128, 8, 16, 64), (1, 1, 4, 16), (33, 1, 3, 16), (300, 8, 64, 16)],
)
def test_triton_align_equals_torch_align(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32)
    expected = align_by_expert(ids, experts, block_m)
    got = align_by_expert_triton(ids, experts, block_m)
    assert torch.equal(got.pair_ids, expected.pair_ids)
    assert torch.equal(got.block_expert, expected.block_expert)
    with pytest.raises(ValueError):
        align_by_expert_triton(torch.zeros(ALIGN_TRITON_MAX_PAIRS + 1, 1, dtype=torch.int32), 4, 16)


@interpreted
def test_triton_experts_default_tiles_torch_align_int64_ids_and_empty_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w13, w2, weights, ids = _experts_case(3, 32, 16, 4, 2, torch.float32, seed=11)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    with monkeypatch.context() as patch:  # batches too large for the Triton alignment use the torch one
        patch.setattr(experts_triton, "ALIGN_TRITON_MAX_PAIRS", 0)
        torch.testing.assert_close(
            fused_experts_triton(x, w13, w2, weights, ids),
            expected,
            rtol=TOL[torch.float32],
            atol=TOL[torch.float32],
        )
    torch.testing.assert_close(
        fused_experts_triton(x, w13, w2, weights, ids),
        expected,
        rtol=TOL[torch.float32],
        atol=TOL[torch.float32],
    )
    int64_ids = fused_experts_triton(x, w13, w2, weights, ids.long())  # transformers' routers return int64
    torch.testing.assert_close(int64_ids, expected, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    empty = fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@needs_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_mm_experts_match_reference(dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _experts_case(19, 32, 24, 6, 3, dtype, seed=12)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        fused_experts_grouped_mm(x, w13, w2, weights, ids).float(),
        expected.float(),
        rtol=TOL[dtype],
        atol=TOL[dtype],
    )


ROUTINGS: dict[str, dict[str, Any]] = {
    "qwen3_norm": dict(top_k=4, scoring="softmax", renormalize=True),
    "qwen3_raw": dict(top_k=4, scoring="softmax", renormalize=False),
    "v2_group_limited": dict(
        top_k=3, scoring="softmax", renormalize=False, num_groups=4, topk_groups=2, routed_scaling_factor=1.7
    ),
    "v3_noaux_tc": dict(
        top_k=6, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2, group_scoring="top2_sum"
    )
    | dict(routed_scaling_factor=2.5, correction_bias=True),
    "moonlight": dict(top_k=6, scoring="sigmoid", renormalize=True, num_groups=1, topk_groups=1)
    | dict(group_scoring="top2_sum", routed_scaling_factor=2.446, correction_bias=True),
}


@interpreted
@pytest.mark.parametrize("variant", sorted(ROUTINGS))
@pytest.mark.parametrize("experts", [24, 32])  # 24: groups of 6, not a power of two
def test_triton_route_matches_reference(variant: str, experts: int) -> None:
    gen = torch.Generator().manual_seed(experts)
    args = dict(ROUTINGS[variant])
    if args.pop("correction_bias", False):
        args["correction_bias"] = torch.rand(experts, generator=gen)
    logits = torch.randn(9, experts, generator=gen)  # fp32: low-precision logits tie, and ties order freely
    want_w, want_ids = _by_id(*route_reference(logits, **args))
    weights, ids = route_triton(logits, **args)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    got_w, got_ids = _by_id(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_registry_picks_the_moe_kernels_on_cuda_by_batch_size() -> None:
    bf16 = torch.bfloat16
    assert select_kernel("moe", "route", platform="cuda", dtype=bf16).impl is route_triton
    assert select_kernel("moe", "experts", platform="cuda", dtype=bf16).name == "triton"
    small = select_kernel("moe", "experts", platform="cuda", dtype=bf16, workload={"num_tokens": 16})
    assert small.name == "triton"
    large = select_kernel(
        "moe", "experts", platform="cuda", dtype=bf16, workload={"num_tokens": GROUPED_MM_MIN_TOKENS}
    )
    assert large.name == "triton"  # measured faster than grouped_mm at every size on the H200
    if GROUPED_MM_AVAILABLE:
        set_kernel_override("moe", "experts", "grouped_mm")
        try:
            forced = select_kernel(
                "moe", "experts", platform="cuda", dtype=bf16, workload={"num_tokens": GROUPED_MM_MIN_TOKENS}
            )
        finally:
            set_kernel_override("moe", "experts", None)
        assert forced.name == "grouped_mm"
    fp16 = select_kernel(
        "moe", "experts", platform="cuda", dtype=torch.float16, workload={"num_tokens": 4096}
    )
    assert fp16.name == "triton"
    by_batch = select_experts_by_batch(platform="cuda", dtype=bf16)
    assert by_batch.kernel_for(GROUPED_MM_MIN_TOKENS - 1).name == "triton"
    assert by_batch.kernel_for(GROUPED_MM_MIN_TOKENS) is large
    on_cpu = select_experts_by_batch(platform="cpu", dtype=torch.float32)
    x, w13, w2, weights, ids = _experts_case(5, 16, 8, 4, 2, torch.float32, seed=13)
    torch.testing.assert_close(
        on_cpu(x, w13, w2, weights, ids), fused_experts_reference(x, w13, w2, weights, ids)
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "experts", "hidden"), [(1, 7, 200), (3, 16, 1536), (5, 4, 48)])
def test_triton_router_logits_match_reference(
    dtype: torch.dtype, tokens: int, experts: int, hidden: int
) -> None:
    """An odd expert count (a half-filled last program), K not a multiple of the block (masked), K over one
    block (the loop), rows of x with a stride: fp32 logits equal to `F.linear(x.float(), w)` but for order."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden + 8, generator=gen).to(dtype)[:, 4 : hidden + 4]
    weight = torch.randn(experts, hidden, generator=gen)
    got = router_logits_triton(x, weight)
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got, router_logits_reference(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32"):
        router_logits_triton(x, weight.half())


def test_router_takes_the_decode_kernel_up_to_its_token_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """`layers/moe.Router`: decode batches through `moe.router_logits`'s fast kernel, larger ones (and every
    batch with the reference forced, the off switch) through `F.linear` on x in fp32."""
    from tokenspeed.layers import linear as linear_layer
    from tokenspeed.layers import moe as moe_layer

    calls: list[int] = []

    def fake_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return router_logits_reference(x, weight)

    def cuda_router_logits() -> Any:
        return select_kernel("moe", "router_logits", platform="cuda", dtype=torch.bfloat16,
                             workload={"num_tokens": (1, ROUTER_TRITON_MAX_TOKENS)})  # fmt: skip

    def router_with(spec: Any) -> Any:  # a Router as it is built on a GPU, here on the CPU
        monkeypatch.setattr(linear_layer, "select_kernel", lambda *args, **kwargs: spec)
        router = moe_layer.Router(32, 8, correction_bias=False, dtype=torch.float32, device="cpu")
        router.weight.data.normal_()
        return router

    fast = cuda_router_logits()
    assert fast.impl is router_logits_triton
    router = router_with(dataclasses.replace(fast, impl=fake_kernel))
    for tokens in (1, ROUTER_TRITON_MAX_TOKENS, ROUTER_TRITON_MAX_TOKENS + 1):
        x = torch.randn(tokens, 32)
        torch.testing.assert_close(router(x), router_logits_reference(x, router.weight))
    assert calls == [1, ROUTER_TRITON_MAX_TOKENS]
    set_kernel_override("moe", "router_logits", "reference")
    try:
        forced = cuda_router_logits()
    finally:
        set_kernel_override("moe", "router_logits", None)
    assert forced.impl is router_logits_reference
    router = router_with(dataclasses.replace(forced, impl=fake_kernel))
    router(torch.randn(1, 32))
    assert calls == [1, ROUTER_TRITON_MAX_TOKENS]  # the reference is the off switch: plain F.linear


@interpreted
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 1100), (6, 2, 64)])
def test_triton_pair_sum_equals_torch_sum(
    tokens: int, top_k: int, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`experts_triton.sum_pairs` (hidden past one block, masked) against torch's k-sum; its off switch."""
    pairs = torch.randn(tokens * top_k, hidden, generator=torch.Generator().manual_seed(tokens)).half()
    want = pairs.view(tokens, top_k, hidden).float().sum(dim=1).half()
    torch.testing.assert_close(experts_triton.sum_pairs(pairs, tokens, top_k), want, rtol=1e-3, atol=1e-3)
    monkeypatch.setenv("TOKENSPEED_MOE_TRITON_SUM", "0")
    torch_sum = pairs.view(tokens, top_k, hidden).sum(dim=1)
    assert torch.equal(experts_triton.sum_pairs(pairs, tokens, top_k), torch_sum)
