"""The native CPU paged prefill attention (`kernels/attention/prefill_paged_cpu.py`): a prompt chunk's
causal attention over its row's pages in place equals SDPA on the gathered keys within fp32 rounding,
for every head shape it takes, chunks from position 0 and after a cached prefix, tiles that do not
divide the rows; what it does not take is refused before anything is read or written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.kernels.attention import prefill_paged_cpu

pytestmark = pytest.mark.skipif(prefill_paged_cpu.load_library() is None, reason="no C compiler")
PAGE_SIZE = 16


def _case(first: int, n: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    length = first + n
    num = -(-length // PAGE_SIZE)
    k = torch.randn(num + 3, PAGE_SIZE, kv_heads, head_dim, generator=gen)
    v = torch.randn(num + 3, PAGE_SIZE, kv_heads, head_dim, generator=gen)
    pages = torch.randperm(num + 3, generator=gen)[:num].to(torch.int32)
    q = torch.randn(n, heads + 3, head_dim, generator=gen)[:, :heads]  # rows strided, heads contiguous
    return q, k, v, pages


def _reference(q, k, v, pages, first):
    n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    keys = k[pages.long()].reshape(-1, kv_heads, head_dim)[: first + n]
    values = v[pages.long()].reshape(-1, kv_heads, head_dim)[: first + n]
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    visible = torch.arange(first + n)[None, :] <= torch.arange(first, first + n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=visible, scale=head_dim**-0.5)
    return out.transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 32), (4, 1, 32), (4, 4, 16), (8, 1, 64),
                                                              (6, 3, 128), (16, 2, 32)])
@pytest.mark.parametrize(("first", "n"), [(0, 1), (0, 5), (0, 77), (30, 1), (40, 33), (3, 130)])
def test_equals_sdpa_within_rounding(heads: int, kv_heads: int, head_dim: int, first: int, n: int) -> None:
    q, k, v, pages = _case(first, n, heads, kv_heads, head_dim)
    plan = prefill_paged_cpu.PagedPrefillRow(pages, first, n, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                             page_size=PAGE_SIZE)
    out = torch.full((n + 2, heads, head_dim), 7.0)
    plan(q, k, v, head_dim**-0.5, out[1 : n + 1])
    torch.testing.assert_close(out[1 : n + 1], _reference(q, k, v, pages, first), rtol=1e-5, atol=1e-5)
    assert (out[0] == 7.0).all() and (out[n + 1] == 7.0).all()  # nothing written outside its rows


def test_refuses_what_it_does_not_take() -> None:
    q, k, v, pages = _case(10, 20, 8, 2, 32)
    assert not prefill_paged_cpu.supports(8, 2, 48) and not prefill_paged_cpu.supports(8, 3, 32)
    with pytest.raises(ValueError):
        prefill_paged_cpu.PagedPrefillRow(pages, 10, 20, heads=8, kv_heads=2, head_dim=48, page_size=PAGE_SIZE)
    with pytest.raises(ValueError):  # pages that do not cover the positions
        prefill_paged_cpu.PagedPrefillRow(pages[:1], 10, 20, heads=8, kv_heads=2, head_dim=32, page_size=PAGE_SIZE)
    with pytest.raises(ValueError):
        prefill_paged_cpu.PagedPrefillRow(pages.long(), 10, 20, heads=8, kv_heads=2, head_dim=32, page_size=PAGE_SIZE)
    plan = prefill_paged_cpu.PagedPrefillRow(pages, 10, 20, heads=8, kv_heads=2, head_dim=32, page_size=PAGE_SIZE)
    out = torch.zeros(20, 8, 32)
    with pytest.raises(ValueError):
        plan(q[:5], k, v, 0.1, out)
    with pytest.raises(ValueError):
        plan(q, k.transpose(1, 2), v, 0.1, out)
    pages[0] = k.shape[0]  # a page outside the pool
    with pytest.raises(ValueError, match="page id"):
        plan(q, k, v, 0.1, out)
    assert not out.any()
