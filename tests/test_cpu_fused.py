"""The CPU forward's fused C ops (`kernels/cpu_fused.py`): each equals its torch ops within fp32 rounding,
checks what goes to C, and the forward with them equals the eager layers within fp32 rounding (same K/V,
hidden states, argmax) with the engine's greedy tokens the same with them on and off
(`disable_cpu_fused_ops`, `TOKENSPEED_CPU_FUSED_OPS=0`); where no C compiler works they are off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.native_helpers import without_a_compiler
from tests.test_cpu_decode_forward import (
    _assert_same_kv,
    _greedy,
    _kv,
    _model,
    _pools_and_forward,
    _rows_batch,
)
from tokenspeed import LLM
from tokenspeed.executor.cpu_decode import CPUDecodeForward
from tokenspeed.kernels import cpu_fused

native = cpu_fused.load_library() is not None
pytestmark = pytest.mark.skipif(not native, reason="no C compiler for the fused CPU ops")


def _rms(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def _ops(heads=4, kv_heads=2, head_dim=16, max_pos=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cos, sin = torch.randn(max_pos, head_dim // 2, generator=gen), torch.randn(max_pos, head_dim // 2, generator=gen)
    ops = cpu_fused.CPUFusedOps(cpu_fused.load_library(), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                cos_cache=cos, sin_cache=sin)
    return ops, cos, sin, gen


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_b", [True, False])
def test_add_rms_norm(rows: int, with_b: bool) -> None:
    ops, _, _, gen = _ops()
    a, b, w = torch.randn(rows, 72, generator=gen), torch.randn(rows, 72, generator=gen), torch.randn(72, generator=gen)
    total = a + b if with_b else a.clone()
    out = ops.add_rms_norm(a, b if with_b else None, ops.check_norm(w), 1e-5)
    assert torch.equal(a, total)  # the sum written in place, exactly
    torch.testing.assert_close(out, _rms(total, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_silu_mul_over_the_range() -> None:
    ops, _, _, gen = _ops()
    gate_up = torch.cat([torch.linspace(-120, 120, 4 * 48).view(4, 48), torch.randn(4, 48, generator=gen)], dim=1)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 200.0, -200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-30)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("normed", [True, False])
def test_qk_norm_rope_store(normed: bool) -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    ops, cos, sin, gen = _ops(heads, kv_heads, head_dim)
    tokens, width = 6, (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen)
    norm = ops.check_norm(torch.randn(heads + kv_heads, head_dim, generator=gen), heads + kv_heads) if normed else None
    positions = torch.tensor([0, 3, 9, 10, 63, 1])
    slots = torch.tensor([7, 0, 11, 3, 4, 20])
    k_flat, v_flat = torch.zeros(24, kv_heads, head_dim), torch.zeros(24, kv_heads, head_dim)
    ops.check_kv(k_flat, v_flat)
    # the CPU forward's torch ops
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    if normed:
        qk = _rms(qk, norm, 1e-6)
    c, s = cos[positions].view(tokens, 1, 1, -1), sin[positions].view(tokens, 1, 1, -1)
    halves = qk.view(tokens, heads + kv_heads, 2, head_dim // 2)
    want = (halves * torch.cat((c, c), 2) + halves.flip(2) * torch.cat((-s, s), 2)).view(tokens, -1)
    want_v = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ops.qk_norm_rope_store(qkv, norm, 1e-6, positions, slots, k_flat, v_flat)
    torch.testing.assert_close(qkv[:, : (heads + kv_heads) * head_dim], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], want_v)  # v untouched
    assert torch.equal(k_flat[slots].view(tokens, -1), qkv[:, heads * head_dim : (heads + kv_heads) * head_dim])
    assert torch.equal(v_flat[slots].view(tokens, -1), want_v)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


def test_bad_positions_slots_and_shapes_are_refused_before_any_write() -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    ops, _, _, gen = _ops(heads, kv_heads, head_dim, max_pos=8)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim, generator=gen)
    k_flat, v_flat = torch.zeros(4, kv_heads, head_dim), torch.zeros(4, kv_heads, head_dim)
    before = qkv.clone()
    with pytest.raises(ValueError, match="position"):
        ops.qk_norm_rope_store(qkv, None, 1e-6, torch.tensor([0, 8]), torch.tensor([0, 1]), k_flat, v_flat)
    with pytest.raises(ValueError, match="slot"):
        ops.qk_norm_rope_store(qkv, None, 1e-6, torch.tensor([0, 1]), torch.tensor([0, 4]), k_flat, v_flat)
    with pytest.raises(ValueError):
        ops.qk_norm_rope_store(qkv, None, 1e-6, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]),
                               k_flat, v_flat)
    assert torch.equal(qkv, before) and not k_flat.any() and not v_flat.any()
    with pytest.raises(ValueError):
        ops.add_rms_norm(torch.randn(3, 16)[:, :8], None, torch.ones(8), 1e-6)  # strided rows
    with pytest.raises(ValueError):
        ops.silu_mul(torch.randn(2, 12))  # halves not a multiple of 8
    with pytest.raises(ValueError):
        ops.check_kv(torch.zeros(4, kv_heads, head_dim), torch.zeros(4, kv_heads, head_dim, dtype=torch.float64))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [[(0, 1), (37, 1), (70, 1)], [(0, 130)], [(20, 30)], [(0, 40), (33, 1), (64, 17)]])
def test_forward_with_fused_ops_close_to_layers(checkpoints, family: str, rows: list[tuple[int, int]]) -> None:
    """Decode, prefill and mixed steps: K/V and every row's hidden states within fp32 rounding of the
    layers'; with `logits_rows` the same argmax."""
    model, config = _model(checkpoints[family])
    batch, num_pages = _rows_batch(config, rows, seed=5)
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 1, fused_ops=True)
    _, rows_kv, rows_fast = _pools_and_forward(model, config, num_pages, 1, fused_ops=True)
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
        pruned = rows_fast.run(batch, logits_rows=True)
        want_logits = model.compute_logits(expected.index_select(0, batch.logits_indices))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_same_kv(eager_kv, fast_kv, close=True)
    _assert_same_kv(eager_kv, rows_kv, close=True)
    got_logits = model.compute_logits(pruned)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-4)
    assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_same_with_fused_ops_on_and_off(checkpoints, monkeypatch, family: str) -> None:
    monkeypatch.delenv(cpu_fused.ENV_SWITCH, raising=False)
    llm = LLM(str(checkpoints[family]), skip_tokenizer_init=True, show_progress=False)
    assert llm.core.executor.runner.cpu_decode.fused is not None  # the default where it builds
    llm.shutdown()
    on, calls = _greedy(checkpoints[family])
    off, off_calls = _greedy(checkpoints[family], disable_cpu_fused_ops=True)
    assert calls == off_calls and calls["decode"] > 10 and calls["prompt"] >= 1
    assert on == off


def test_fused_ops_switches_and_no_compiler(checkpoints, monkeypatch, tmp_path) -> None:
    """On by default where it builds; `fused_ops=False` and `TOKENSPEED_CPU_FUSED_OPS=0` turn it off, and
    where no C compiler works the forward keeps its torch ops silently."""
    monkeypatch.delenv(cpu_fused.ENV_SWITCH, raising=False)
    model, config = _model(checkpoints["qwen3"])
    kv = _kv(config, 4, 0)
    assert CPUDecodeForward.build(model, kv).fused is not None
    assert CPUDecodeForward.build(model, kv, fused_ops=False).fused is None
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    assert CPUDecodeForward.build(model, kv).fused is None
    monkeypatch.delenv(cpu_fused.ENV_SWITCH)
    without_a_compiler(monkeypatch, tmp_path, cpu_fused.NATIVE)
    assert cpu_fused.load_library() is None
    forward = CPUDecodeForward.build(model, kv)
    assert forward is not None and forward.fused is None
