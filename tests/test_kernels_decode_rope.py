"""`attention.decode_rope` on the CPU under Triton's interpreter: the decode kernel doing `kvstore.rope_write`'s
work itself (q/k norm, RoPE, the K/V store) against the two kernels one after the other.

Cases: fp32 and fp16, Qwen3's q/k norms, partial rotary, an fp8 cache with per-head scales, a sliding
window, one and several KV splits (the new position in the first, a middle or the last split), a
padding row (length 0, slot -1).
"""

from __future__ import annotations

import pytest
import torch

from tests.paged_kernels import shuffled_page_table
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.attention.decode_triton import decode_attention_triton, decode_rope_attention_triton
from tokenspeed.kernels.attention.paged_reference import decode_rope_reference
from tokenspeed.kernels.kvstore.rope_write_triton import rope_write_triton
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


def _step(dtype: torch.dtype, lengths: list[int], rotary_half: int, norm: bool, fp8: bool, gen: torch.Generator):
    heads, kv_heads, dim, page_size = 8, 2, 16, 4
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=2)
    cache_dtype = FP8_DTYPE if fp8 else dtype
    caches = [(torch.randn(num_pages, page_size, kv_heads, dim, generator=gen) * 0.5).to(cache_dtype)
              for _ in range(2)]
    rows = len(lengths)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    positions = torch.tensor([max(n - 1, 0) for n in lengths])
    slots = torch.tensor([int(table[r, (n - 1) // page_size]) * page_size + (n - 1) % page_size if n else -1
                          for r, n in enumerate(lengths)], dtype=torch.int32)
    extra = {}
    if norm:
        extra |= {"q_norm_weight": (torch.rand(dim, generator=gen) + 0.5).to(dtype),
                  "k_norm_weight": (torch.rand(dim, generator=gen) + 0.5).to(dtype), "norm_eps": 1e-6}
    if fp8:
        extra |= {"k_scale": torch.rand(kv_heads, generator=gen) / 32 + 1 / 64,
                  "v_scale": torch.rand(kv_heads, generator=gen) / 32 + 1 / 64}
    rope = (positions, torch.randn(64, rotary_half, generator=gen), torch.randn(64, rotary_half, generator=gen))
    return q, k, v, rope, caches, slots, table, torch.tensor(lengths, dtype=torch.int32), extra


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rotary_half", "norm", "fp8", "window"),
                         [(8, False, False, None), (6, True, False, None), (8, True, True, None), (8, False, False, 5)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_rope_decode_equals_rope_write_then_decode(
    dtype: torch.dtype, rotary_half: int, norm: bool, fp8: bool, window: int | None, num_splits: int
) -> None:
    if fp8 and dtype == torch.float32:
        pytest.skip("fp8 caches serve bf16/fp16 models")
    gen = torch.Generator().manual_seed(rotary_half + num_splits)
    q, k, v, (pos, cos, sin), caches, slots, table, lens, extra = _step(
        dtype, [13, 0, 1, 9], rotary_half, norm, fp8, gen)
    norms = {name: extra[name] for name in ("q_norm_weight", "k_norm_weight", "norm_eps") if name in extra}
    scales = {name: extra[name] for name in ("k_scale", "v_scale") if name in extra}
    separate = [c.clone() for c in caches]
    rotated = rope_write_triton(q.clone(), k, v, pos, cos, sin, *separate, slots, **norms, **scales)
    want = decode_attention_triton(rotated, *separate, table, lens, scale=0.3, sliding_window=window,
                                   num_splits=num_splits, **scales)
    fused = [c.clone() for c in caches]
    q_before = q.clone()
    got = decode_rope_attention_triton(q, k, v, pos, cos, sin, *fused, slots, table, lens, scale=0.3,
                                       sliding_window=window, num_splits=num_splits, **norms, **scales)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for mine, theirs in zip(fused, separate, strict=True):  # the same bytes land in the cache
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=tol, atol=tol)
    assert torch.equal(q, q_before)  # q is read, not rotated in place
    oracle = [c.clone() for c in caches]
    reference = decode_rope_reference(q, k, v, pos, cos, sin, *oracle, slots, table, lens, scale=0.3,
                                      sliding_window=window, **norms, **scales)
    torch.testing.assert_close(got.float(), reference.float(), rtol=5 * tol, atol=5 * tol)
    assert got[1].abs().max() == 0  # the padding row: no keys, zeros, nothing stored


@interpreted
def test_fused_rope_decode_refuses_several_tokens_a_row() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, (pos, cos, sin), caches, slots, table, lens, _ = _step(torch.float32, [5, 6], 8, False, False, gen)
    with pytest.raises(ValueError, match="q has 4 tokens"):
        decode_rope_attention_triton(torch.cat([q, q]), k, v, pos, cos, sin, *caches, slots, table, lens, scale=1.0)
