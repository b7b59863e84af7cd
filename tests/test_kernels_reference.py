"""Reference kernels against straightforward dense formulas.

The paged attention oracle is itself checked here against attention over
contiguous tensors, so a page-table bug cannot hide in both at once.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.kernels.activation.reference import silu_and_mul_reference
from tokenspeed.kernels.attention.paged_reference import paged_attention_reference
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

PAGE_SIZE = 4


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Causal attention of the last q_len positions of one sequence, keys `[seq, kv_heads, dim]`."""
    q_len, seq = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    i = torch.arange(seq - q_len, seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_matches_dense_over_two_steps(heads: int, kv_heads: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, lengths, cached = 8, [9, 1, 6], [5, 0, 3]
    full_k = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    full_v = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    full_q = [torch.randn(n, heads, dim, generator=gen) for n in lengths]
    pool = list(range(12))
    random.Random(0).shuffle(pool)
    pages = [pool[0:3], pool[3:4], pool[4:6]]
    k_cache = torch.zeros(12, PAGE_SIZE, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    scale = dim**-0.5

    def step(spans: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[int]]:
        rows = [RowSpec([0] * (b - a), a, pages[r]) for r, (a, b) in enumerate(spans)]
        batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=[])
        q = torch.cat([full_q[r][a:b] for r, (a, b) in enumerate(spans)])
        k = torch.cat([full_k[r][a:b] for r, (a, b) in enumerate(spans)])
        v = torch.cat([full_v[r][a:b] for r, (a, b) in enumerate(spans)])
        out = paged_attention_reference(
            q, k, v, k_cache, v_cache, batch.attn, scale=scale, sliding_window=window
        )
        return list(out.split([b - a for a, b in spans])), batch.attn.slot_mapping.tolist()

    step([(0, c) for c in cached])
    outputs, slots = step([(c, n) for c, n in zip(cached, lengths)])
    for r, (c, n) in enumerate(zip(cached, lengths)):
        expected = _dense_attention(full_q[r][c:n], full_k[r], full_v[r], scale, window)
        torch.testing.assert_close(outputs[r].double(), expected, rtol=1e-5, atol=1e-5)
    # The second step's K landed at its slots.
    flat = k_cache.view(-1, kv_heads, dim)
    new_k = torch.cat([full_k[r][c:n] for r, (c, n) in enumerate(zip(cached, lengths))])
    torch.testing.assert_close(flat[slots], new_k, rtol=0, atol=0)


def test_paged_attention_keeps_low_precision_dtype() -> None:
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    k = torch.randn(3, 1, 8, dtype=torch.bfloat16)
    batch = build_forward_batch([RowSpec([1, 2, 3], 0, [1])], PAGE_SIZE, logits_indices=[2])
    caches = [torch.zeros(2, PAGE_SIZE, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    out = paged_attention_reference(q, k, k.clone(), *caches, batch.attn, scale=0.3)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_rms_norm_with_and_without_residual() -> None:
    x = torch.randn(5, 16)
    residual = torch.randn(5, 16)
    weight = torch.rand(16) + 0.5
    expected = weight * (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-6), expected)
    normed, summed = rms_norm_reference(x, weight, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6))


def test_silu_and_mul() -> None:
    x = torch.randn(4, 2 * 6)
    torch.testing.assert_close(silu_and_mul_reference(x), F.silu(x[:, :6]) * x[:, 6:])
