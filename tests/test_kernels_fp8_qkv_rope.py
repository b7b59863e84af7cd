"""The FP8 one-token QKV GEMV doing `kvstore.rope_write`'s work in its epilogue (`kvstore/rope_store.py`), on
the CPU under Triton's interpreter: bit for bit the GEMV followed by `rope_write` (q, and the K/V caches in
fp16, fp32 and e4m3 with per-head scales), padding slots untouched; and the arguments it refuses."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.gemm.fp8_gemv_triton import Fp8GemvConfig, fp8_gemv_triton
from tokenspeed.kernels.kvstore.rope_store import RopeStore
from tokenspeed.kernels.kvstore.rope_write_triton import rope_write_triton
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, PER_CHANNEL_BLOCK, quantize_weight_block

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)

Q_HEADS, KV_HEADS, DIM, HIDDEN, PAGE, PAGES = 4, 2, 32, 256, 4, 6


def _case(dtype: torch.dtype, block: tuple[int, int], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = (Q_HEADS + 2 * KV_HEADS) * DIM
    w8, scales = quantize_weight_block(torch.randn(n, HIDDEN, generator=gen) * HIDDEN**-0.5, block)
    angles = torch.arange(64)[:, None] * 0.37 ** torch.arange(DIM // 2)[None, :]
    return {
        "x": torch.randn(3, HIDDEN, generator=gen).to(dtype),
        "norm": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
        "w8": w8, "scales": scales, "block": block,
        "cos": angles.cos(), "sin": angles.sin(),
        "positions": torch.tensor([5, 17, 63]),
        "slots": torch.tensor([9, -1, 22]),  # the second token is padding: its K/V must not land anywhere
    }  # fmt: skip


def _caches(cache_dtype: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fill = torch.full((PAGES, PAGE, KV_HEADS, DIM), 0.5).to(dtype)
    return fill.to(cache_dtype), fill.clone().to(cache_dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("cache", ["activation", "fp8-per-head"])
@pytest.mark.parametrize("block", [(32, 128), PER_CHANNEL_BLOCK])
def test_rope_store_equals_the_gemv_then_rope_write(dtype: torch.dtype, cache: str, block: tuple[int, int]) -> None:
    c = _case(dtype, block)
    config = Fp8GemvConfig(block_n=8, groups=2, num_warps=4, stages=1)
    cache_dtype = FP8_DTYPE if cache.startswith("fp8") else dtype
    kv_scales = {}
    if cache_dtype == FP8_DTYPE:
        kv_scales = {"k_scale": torch.tensor([0.02, 0.05]), "v_scale": torch.tensor([0.03, 0.01])}
    gemv = dict(block_size=block, config=config, norm_weight=c["norm"], eps=1e-6)

    qkv = fp8_gemv_triton(c["x"], c["w8"], c["scales"], **gemv)
    q, k, v = qkv.split([Q_HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    k_want, v_want = _caches(cache_dtype, dtype)
    q_want = rope_write_triton(q.reshape(3, Q_HEADS, DIM).clone(), k.reshape(3, KV_HEADS, DIM),
                               v.reshape(3, KV_HEADS, DIM), c["positions"], c["cos"], c["sin"], k_want, v_want,
                               c["slots"], **kv_scales)  # fmt: skip

    k_got, v_got = _caches(cache_dtype, dtype)
    store = RopeStore(c["positions"], c["cos"], c["sin"], k_got, v_got, c["slots"], Q_HEADS, KV_HEADS, **kv_scales)
    q_got = fp8_gemv_triton(c["x"], c["w8"], c["scales"], **gemv, rope=store)
    assert q_got.shape == (3, Q_HEADS, DIM) and torch.equal(q_got, q_want)
    for got, want in ((k_got, k_want), (v_got, v_want)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    untouched, _ = _caches(cache_dtype, dtype)
    written = torch.zeros(PAGES * PAGE, dtype=torch.bool)
    written[[9, 22]] = True
    assert torch.equal(k_got.view(PAGES * PAGE, -1)[~written].view(torch.uint8),
                       untouched.view(PAGES * PAGE, -1)[~written].view(torch.uint8))  # fmt: skip
    assert not torch.equal(k_got.view(PAGES * PAGE, -1)[written].view(torch.uint8),
                           untouched.view(PAGES * PAGE, -1)[written].view(torch.uint8))  # fmt: skip


@interpreted
def test_rope_store_refuses_what_it_cannot_fold() -> None:
    c = _case(torch.float32, (16, 128))
    k_cache, v_cache = _caches(torch.float32, torch.float32)
    store = RopeStore(c["positions"], c["cos"], c["sin"], k_cache, v_cache, c["slots"], Q_HEADS, KV_HEADS)
    config = Fp8GemvConfig(block_n=8, groups=2, num_warps=4, stages=1)
    with pytest.raises(ValueError, match="scale block"):  # rows j and j + 16 of a head in different blocks
        fp8_gemv_triton(c["x"], c["w8"], c["scales"], block_size=(16, 128), config=config, rope=store)
    wrong_heads = RopeStore(c["positions"], c["cos"], c["sin"], k_cache, v_cache, c["slots"], Q_HEADS + 1, KV_HEADS)
    with pytest.raises(ValueError, match="fused QKV weight"):
        fp8_gemv_triton(c["x"], c["w8"], c["scales"], block_size=(16, 128), config=config, rope=wrong_heads)
    with pytest.raises(ValueError, match="QKV projection's form"):
        fp8_gemv_triton(c["x"], c["w8"], c["scales"], block_size=(16, 128), config=config, rope=store,
                        residual=torch.zeros(3, (Q_HEADS + 2 * KV_HEADS) * DIM))  # fmt: skip


@interpreted
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE])
def test_attention_layer_folds_rope_write_into_the_qkv_kernel(
    cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GQAAttention` with FP8 weights on their fused GEMV and the Triton `rope_write` (as on CUDA): a one-token
    decode step gives the same output and caches with the fold on and off (`TOKENSPEED_FP8_QKV_ROPE=0`)."""
    from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
    from tokenspeed.kernels.gemm.fp8_dispatch import Fp8GemmByBatch
    from tokenspeed.layers import linear as linear_module
    from tokenspeed.layers.attention import GQAAttention
    from tokenspeed.layers.norm import RMSNorm
    from tokenspeed.layers.rope_scaling import RopeConfig
    from tokenspeed.layers.rotary_embedding import RotaryEmbedding

    monkeypatch.setattr(linear_module, "select_decode_gemm", lambda mode, **_: ((lambda *a, **k: None), 1))
    monkeypatch.setattr(Fp8GemmByBatch, "fused_decode", property(lambda self: fp8_gemv_triton))
    torch.manual_seed(0)
    rotary = RotaryEmbedding(RopeConfig(), head_dim=DIM, max_position_embeddings=64)
    layer = GQAAttention(hidden_size=HIDDEN, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, rotary=rotary)
    for param in layer.parameters():
        param.data.copy_(torch.randn_like(param) * HIDDEN**-0.5)
    layer.qkv_proj.use_fp8((32, 128), checkpoint_block=None)
    layer.o_proj.use_fp8((32, 128), checkpoint_block=None)
    layer.rope_write = rope_write_triton
    norm = RMSNorm(HIDDEN, 1e-6)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("TOKENSPEED_FP8_QKV_ROPE", switch)
        assert layer._folds_rope(1) == (switch == "1")
        k_cache, v_cache = (torch.zeros(PAGES, PAGE, KV_HEADS, DIM).to(cache_dtype) for _ in range(2))
        prefill = build_forward_batch([RowSpec([0] * 9, 0, [3, 0, 5])], PAGE, logits_indices=[])
        gen = torch.Generator().manual_seed(1)
        layer(prefill.positions, torch.randn(9, HIDDEN, generator=gen), prefill.attn, k_cache, v_cache)
        decode = build_forward_batch([RowSpec([0], 9, [3, 0, 5])], PAGE, logits_indices=[])
        stream = torch.randn(1, HIDDEN, generator=gen)
        out = layer(decode.positions, stream, decode.attn, k_cache, v_cache, input_norm=norm, residual=stream)
        results[switch] = (out, k_cache.view(torch.uint8), v_cache.view(torch.uint8))
    for on, off in zip(results["1"], results["0"]):
        assert torch.equal(on, off)
