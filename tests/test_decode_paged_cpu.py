"""The native CPU paged decode kernel (`kernels/attention/decode_paged_cpu.py`) against the gather + SDPA
path it replaces in the CPU decode forward: random paged K/V in scattered pages, rows of different
lengths (partial last pages, one position, page boundaries), GQA groups and head sizes, within 1e-5
(fp32: the two sum in different orders, so not bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tokenspeed.kernels.attention import decode_paged_cpu

pytestmark = pytest.mark.skipif(decode_paged_cpu.load_library() is None, reason="no C compiler")


def _gather_sdpa(q: Tensor, k: Tensor, v: Tensor, table: Tensor, lens: Tensor, scale: float) -> Tensor:
    """The CPU decode forward's torch path: each row's pages gathered, padded, masked, one SDPA call."""
    rows, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k.shape
    span_pages = -(-int(lens.max()) // page_size)
    span = span_pages * page_size
    pages = table[:, :span_pages].long().reshape(-1)
    keys = k.view(k.shape[0], -1).index_select(0, pages).view(rows, span, kv_heads, head_dim)
    values = v.view(v.shape[0], -1).index_select(0, pages).view(rows, span, kv_heads, head_dim)
    mask = torch.zeros(rows, 1, 1, span).masked_fill_((torch.arange(span) >= lens[:, None]).view(rows, 1, 1, span),
                                                      float("-inf"))
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, head_dim),
                                         keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, head_dim)


def _inputs(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + 5
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(counts) + 2, dtype=torch.int32)  # padded past each row's pages
    used = 0
    for row, count in enumerate(counts):
        table[row, :count] = order[used : used + count]
        used += count
    # q as the forward passes it: a strided view of the fused q/k rows
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen) * 2
    return qk[:, :heads], k, v, table, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 32), (4, 4, 16), (8, 1, 64), (6, 2, 128), (12, 4, 24)])
@pytest.mark.parametrize("page_size", [16, 1, 6])
@pytest.mark.parametrize("lens", [[1], [37], [16, 5, 70, 33, 1, 48], [513, 200]])
def test_matches_gather_sdpa(lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
    q, k, v, table, seq_lens = _inputs(lens, heads, kv_heads, head_dim, page_size, seed=len(lens) + page_size)
    scale = head_dim**-0.5
    expected = _gather_sdpa(q, k, v, table, seq_lens, scale)
    got = decode_paged_cpu.paged_decode_attention(q, k, v, table, seq_lens, max(lens), scale)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite() -> None:
    """Scores far apart (a few hundred): the softmax subtracts the row's max, weights of ~0 stay finite."""
    q, k, v, table, seq_lens = _inputs([100, 7], 8, 2, 32, 16, seed=3)
    q = q * 30
    got = decode_paged_cpu.paged_decode_attention(q, k, v, table, seq_lens, 100, 32**-0.5)
    torch.testing.assert_close(got, _gather_sdpa(q, k, v, table, seq_lens, 32**-0.5), rtol=1e-5, atol=1e-5)


def test_rejects_out_of_range_lengths_and_pages() -> None:
    """Checked before anything is read: a length over max_seq_len, a page id outside the pool, a table too
    narrow, other dtypes, head shapes the kernel does not hold."""
    q, k, v, table, seq_lens = _inputs([20, 9], 8, 2, 32, 16, seed=4)
    with pytest.raises(ValueError, match="length"):
        decode_paged_cpu.paged_decode_attention(q, k, v, table, seq_lens, 19, 1.0)
    bad = table.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="page id"):
        decode_paged_cpu.paged_decode_attention(q, k, v, bad, seq_lens, 20, 1.0)
    with pytest.raises(TypeError):
        decode_paged_cpu.paged_decode_attention(q, k, v, table.long(), seq_lens, 20, 1.0)
    with pytest.raises(ValueError, match="wide enough"):
        decode_paged_cpu.paged_decode_attention(q, k, v, table[:, :1], seq_lens, 20, 1.0)
    assert not decode_paged_cpu.supports(8, 2, 36) and not decode_paged_cpu.supports(64, 2, 32)
