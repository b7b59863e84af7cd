"""Triton kernels against their torch references, on the CPU under Triton's interpreter.

Triton chooses between interpreting and compiling when `triton.language` is
first imported, so this module sets TRITON_INTERPRET=1 before anything imports
triton (the conftest does not), through `tests/triton_interpreter.py`. Should
triton already be loaded in compiled mode (another module imported it first),
the whole file reruns in a fresh process instead. With CUDA present the GPU versions
(`test_kernels_triton_gpu.py`) cover the kernels and this file is skipped.

The interpreter runs every program in Python and mishandles bf16, so shapes are
tiny and dtypes are fp32 and fp16; the cases are chosen to cover GQA ratios
1/4/8, MQA, page sizes 1/4/16, ragged rows (empty, single-token, several
pages), sliding windows, several KV splits and skipped slots.
"""

from __future__ import annotations

import pytest
import torch

from tests.paged_kernels import shuffled_page_table
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.kernels.activation.reference import silu_and_mul_reference
from tokenspeed.kernels.activation.silu_triton import silu_and_mul_triton
from tokenspeed.kernels.attention.decode_plan import SplitLaunch, choose_fold, choose_num_splits
from tokenspeed.kernels.attention.decode_triton import (
    _paged_decode,
    decode_attention_triton,
    verify_attention_triton,
)
from tokenspeed.kernels.attention.extend_triton import extend_attention_triton
from tokenspeed.kernels.attention.paged_reference import (
    decode_attention_reference,
    extend_attention_reference,
    verify_attention_reference,
)
from tokenspeed.kernels.kvstore.reference import rope_write_reference, write_kv_reference
from tokenspeed.kernels.kvstore.rope_write_triton import rope_write_triton
from tokenspeed.kernels.kvstore.write_triton import write_kv_triton
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference
from tokenspeed.kernels.norm.rms_triton import rms_norm_triton
from tokenspeed.kernels.registry import list_kernels
from tokenspeed.kernels.rope.reference import apply_rope_reference
from tokenspeed.kernels.rope.rope_triton import apply_rope_triton
from tokenspeed.kernels.sampling.reference import filter_probs_reference, sample_reference
from tokenspeed.kernels.sampling.sample_triton import kept_threshold_bits, sample_triton
from tokenspeed.layers.attention_backend import PagedAttentionBackend

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
LOG2E = 1.4426950408889634


test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


def _paged_kv(
    lengths: list[int], page_size: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches and a page table giving each row its own shuffled pages (unused entries 0)."""
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=2)
    shape = (num_pages, page_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache, v_cache, table


# --- kvstore.write ---------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize(("dtype", "page_size"), [(torch.float32, 1), (torch.float16, 16)])
def test_write_kv_matches_reference_and_skips_negative_slots(dtype: torch.dtype, page_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    kv_heads, dim, tokens = 2, 24, 7
    qkv = torch.randn(tokens, 4 * kv_heads * dim, generator=gen).to(dtype)  # k/v are strided views
    k = qkv[:, 2 * kv_heads * dim : 3 * kv_heads * dim].view(tokens, kv_heads, dim)
    v = qkv[:, 3 * kv_heads * dim :].view(tokens, kv_heads, dim)
    caches = [torch.full((8, page_size, kv_heads, dim), 7.0, dtype=dtype) for _ in range(4)]
    total = 8 * page_size
    slots = torch.tensor([total - 1, -1, 0, total // 2, -1, 2, total - 3], dtype=torch.int32)
    write_kv_triton(k, v, caches[0], caches[1], slots)
    write_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat_k = caches[0].view(-1, kv_heads, dim)
    written = slots[slots >= 0].long()
    assert torch.equal(flat_k[written], k[slots >= 0])
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[written] = False
    assert bool((flat_k[untouched] == 7.0).all())


# --- attention.decode ------------------------------------------------------------------------

DECODE_CASES = [
    # dtype, heads, kv_heads, page_size, num_splits, window
    (torch.float32, 4, 4, 1, 1, None),  # MHA (ratio 1), token-granular pages
    (torch.float16, 8, 2, 16, 3, None),  # GQA 4, three splits
    (torch.float32, 8, 1, 4, 4, 7),  # MQA (ratio 8), window, four splits
    (torch.float16, 16, 2, 16, 2, 20),  # GQA 8, window longer than a split
]


@interpreted
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "page_size", "num_splits", "window"), DECODE_CASES)
def test_decode_attention_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, page_size: int, num_splits: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + page_size)
    dim = 32
    lengths = [37, 0, 1, 90]  # ragged; 0 is a padding row (CUDA-graph bucket)
    k_cache, v_cache, table = _paged_kv(lengths, page_size, kv_heads, dim, dtype, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    args = (q, k_cache, v_cache, table, seq_lens)
    out = decode_attention_triton(*args, scale=dim**-0.5, sliding_window=window, num_splits=num_splits)
    expected = decode_attention_reference(*args, scale=dim**-0.5, sliding_window=window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert bool((out[1] == 0).all())


PAGE_LIST_CASES = [
    # dtype, page_size, q_len, num_splits, window
    (torch.float32, 4, 1, 1, None),  # chunks of 448 positions: rows of 1000 and 2100 cross several
    (torch.float16, 16, 1, 2, 300),  # chunks of 1984 positions; a window that starts mid-page
    (torch.float32, 4, 1, 1, 1499),  # a window from mid-page over several chunks: each spans 113 pages
    (torch.float32, 4, 3, 3, 50),  # verify rows, three tokens folded
]


@interpreted
@pytest.mark.parametrize(("dtype", "page_size", "q_len", "num_splits", "window"), PAGE_LIST_CASES)
def test_page_list_launch_gives_the_in_loop_lookup_bit_for_bit(
    dtype: torch.dtype, page_size: int, q_len: int, num_splits: int, window: int | None
) -> None:
    """`SplitLaunch.page_list` (a split's page ids read per chunk into registers, each tile's taken from
    there) runs the same tiles in the same order as the lookup inside the loop: the same output bit for
    bit, over rows that cross chunk boundaries, and the reference's."""
    gen = torch.Generator().manual_seed(page_size * 10 + q_len)
    heads, kv_heads, dim = 8, 2, 32
    lengths = [1000, 0, q_len + 2, 2100]
    k_cache, v_cache, table = _paged_kv(lengths, page_size, kv_heads, dim, dtype, gen)
    q = torch.randn(len(lengths) * q_len, heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32))
    kwargs = dict(q_len=q_len, scale=dim**-0.5, sliding_window=window, num_splits=num_splits, k_scale=None,
                  v_scale=None)  # fmt: skip
    listed = _paged_decode(*args, launch=SplitLaunch(64, 3, page_list=True), **kwargs)
    looked_up = _paged_decode(*args, launch=SplitLaunch(64, 3), **kwargs)
    torch.testing.assert_close(listed, looked_up, rtol=0, atol=0)
    expected = verify_attention_reference(*args, q_len=q_len, scale=dim**-0.5, sliding_window=window)
    torch.testing.assert_close(listed.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


# --- attention.verify: q_len tokens per row (speculative verification) ------------------------------

VERIFY_CASES = [
    # dtype, heads, kv_heads, q_len, num_splits, window, fold (None: the kernel's choice)
    (torch.float32, 8, 2, 4, 1, None, None),  # GQA 4 x 4 tokens folded into one 16-row tile
    (torch.float16, 8, 2, 5, 3, None, None),  # prime q_len: all 5 tokens folded (20 rows -> 32)
    (torch.float32, 8, 1, 3, 4, 6, None),  # MQA, a window shorter than the verified tokens' span
    (torch.float16, 16, 2, 6, 2, None, 1),  # folding off: one program per token
    (torch.float32, 4, 4, 8, 2, 20, 4),  # MHA, two 4-token groups per row
    (torch.float32, 8, 2, 1, 3, None, None),  # q_len 1 is plain decode
]


@interpreted
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "q_len", "num_splits", "window", "fold"), VERIFY_CASES)
def test_verify_attention_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, q_len: int,
                                            num_splits: int, window: int | None, fold: int | None) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + q_len)
    dim, page_size = 32, 4
    lengths = [37, 0, q_len, 2, 70]  # ragged; 0 is padding; a row shorter than q_len sees nothing early on
    k_cache, v_cache, table = _paged_kv(lengths, page_size, kv_heads, dim, dtype, gen)
    q = torch.randn(len(lengths) * q_len, heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32))
    out = verify_attention_triton(*args, q_len=q_len, scale=dim**-0.5, sliding_window=window,
                                  num_splits=num_splits, fold=fold)
    expected = verify_attention_reference(*args, q_len=q_len, scale=dim**-0.5, sliding_window=window)
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert bool((out[q_len : 2 * q_len] == 0).all())  # the padding row
    if q_len == 1:
        torch.testing.assert_close(out, decode_attention_triton(*args, scale=dim**-0.5, sliding_window=window,
                                                                num_splits=num_splits), rtol=0, atol=0)


def test_verify_fold_is_the_largest_divisor_within_the_tile() -> None:
    assert [choose_fold(4, q) for q in (1, 2, 3, 4, 5, 8, 16, 17)] == [1, 2, 3, 4, 5, 8, 16, 1]
    assert [choose_fold(8, q) for q in (4, 8, 9, 16)] == [4, 8, 3, 8]
    assert choose_fold(64, 4) == 1 and choose_fold(128, 2) == 1  # one token's heads fill the tile


@interpreted
def test_decode_accepts_int64_tables_and_strided_queries() -> None:
    """The executor's tables are int64 today, and q is a view of the fused QKV output."""
    gen = torch.Generator().manual_seed(5)
    dim, heads, kv_heads = 16, 4, 2
    lengths = [5, 23]
    k_cache, v_cache, table = _paged_kv(lengths, 4, kv_heads, dim, torch.float32, gen)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(2, heads, dim)
    seq_lens = torch.tensor(lengths)
    out = decode_attention_triton(q, k_cache, v_cache, table.long(), seq_lens, scale=0.3, num_splits=2)
    expected = decode_attention_reference(q, k_cache, v_cache, table, seq_lens, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_num_splits_fill_the_gpu_and_respect_short_contexts() -> None:
    assert choose_num_splits(1, 8, 32768, "cpu") == 64  # one long row: spread over every SM
    assert choose_num_splits(256, 8, 32768, "cpu") <= 4  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 200, "cpu") == 1  # too short to be worth splitting


# --- attention.extend ------------------------------------------------------------------------

EXTEND_CASES = [
    # dtype, heads, kv_heads, page_size, window
    (torch.float32, 4, 4, 1, None),
    (torch.float16, 8, 2, 16, None),
    (torch.float32, 8, 1, 4, 6),
    (torch.float16, 8, 1, 16, 9),
]


@interpreted
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "page_size", "window"), EXTEND_CASES)
def test_extend_attention_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, page_size: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim = 32
    # (new tokens, kv length): fresh prompt, decode row, empty row, chunk after a cached prefix
    rows = [(20, 20), (1, 9), (0, 4), (18, 45)]
    k_cache, v_cache, table = _paged_kv([n for _, n in rows], page_size, kv_heads, dim, dtype, gen)
    q_lens = torch.tensor([q for q, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), heads, dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, query_start, seq_lens, table)
    out = extend_attention_triton(*args, scale=dim**-0.5, sliding_window=window, max_query_len=20)
    expected = extend_attention_reference(*args, scale=dim**-0.5, sliding_window=window)
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@interpreted
def test_extend_spans_several_query_tiles() -> None:
    """70 new tokens after a 30-token prefix: two 64-token tiles, the second on the causal diagonal."""
    gen = torch.Generator().manual_seed(3)
    dim, heads, kv_heads = 16, 2, 1
    k_cache, v_cache, table = _paged_kv([100], 16, kv_heads, dim, torch.float32, gen)
    q = torch.randn(70, heads, dim, generator=gen)
    args = (q, k_cache, v_cache, torch.tensor([0, 70]), torch.tensor([100]), table)
    out = extend_attention_triton(*args, scale=0.25)  # max_query_len derived from query_start
    torch.testing.assert_close(out, extend_attention_reference(*args, scale=0.25), rtol=2e-5, atol=2e-5)


# --- the layer's backend: decode vs extend per batch ---------------------------------------------


def _backend(name: str) -> PagedAttentionBackend:
    def spec(family: str, mode: str):  # noqa: ANN202
        return next(s for s in list_kernels(family) if s.mode == mode and s.name == name)

    return PagedAttentionBackend(
        spec("kvstore", "write"), spec("attention", "decode"), spec("attention", "extend"), spec("attention", "verify")
    )


@interpreted
def test_backend_prefill_decode_and_verify_match_reference_backend() -> None:
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, page_size = 4, 2, 16, 4
    reference = _backend("reference")
    triton_backend = _backend("triton")
    pages = [[3, 0, 5], [1, 4]]
    caches = [torch.zeros(6, page_size, kv_heads, dim) for _ in range(4)]
    for step_rows in (
        [RowSpec([0] * 9, 0, pages[0]), RowSpec([0] * 5, 0, pages[1])],
        [RowSpec([0], 9, pages[0]), RowSpec([0], 5, pages[1])],
        [RowSpec([0] * 3, 9, pages[0]), RowSpec([0] * 3, 5, pages[1])],  # verify rows: a token and 2 drafts
    ):
        batch = build_forward_batch(step_rows, page_size, logits_indices=[])
        tokens = batch.num_tokens
        q = torch.randn(tokens, heads, dim, generator=gen)
        k = torch.randn(tokens, kv_heads, dim, generator=gen)
        v = torch.randn(tokens, kv_heads, dim, generator=gen)
        got = triton_backend(q, k, v, caches[0], caches[1], batch.attn, scale=0.25)
        want = reference(q, k, v, caches[2], caches[3], batch.attn, scale=0.25)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)


@interpreted
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_layer_fused_rope_write_equals_the_separate_kernels(qk_norm: bool) -> None:
    """`GQAAttention` with `kvstore.rope_write` (the Triton kernel, as on CUDA) against the same layer running
    q/k norm, RoPE and the store as separate kernels (its REFERENCE, as on the CPU): prefill then decode."""
    from tokenspeed.layers.attention import GQAAttention
    from tokenspeed.layers.rope_scaling import RopeConfig
    from tokenspeed.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, dim, page_size = 4, 2, 16, 4
    rotary = RotaryEmbedding(RopeConfig(), head_dim=dim, max_position_embeddings=64)
    layer = GQAAttention(hidden_size=32, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rotary=rotary,
                         qk_norm_eps=1e-6 if qk_norm else None)
    for name, param in layer.named_parameters():
        param.data.copy_(torch.rand_like(param) + 0.5 if "norm" in name else torch.randn_like(param) * 0.2)
    assert layer.rope_write is None  # CPU: the separate kernels
    pages = [[3, 0, 5], [1, 4]]
    caches = [torch.zeros(6, page_size, kv_heads, dim) for _ in range(4)]
    for step_rows in (
        [RowSpec([0] * 9, 0, pages[0]), RowSpec([0] * 5, 0, pages[1])],
        [RowSpec([0], 9, pages[0]), RowSpec([0], 5, pages[1])],
    ):
        batch = build_forward_batch(step_rows, page_size, logits_indices=[])
        hidden = torch.randn(batch.num_tokens, 32)
        layer.rope_write = None
        want = layer(batch.positions, hidden, batch.attn, caches[2], caches[3])
        layer.rope_write = rope_write_triton
        got = layer(batch.positions, hidden, batch.attn, caches[0], caches[1])
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(caches[0], caches[2], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


def test_backend_selection_on_cuda_and_reference_override(monkeypatch: pytest.MonkeyPatch) -> None:
    picked = PagedAttentionBackend.select(
        platform="cuda", dtype=torch.bfloat16, head_dim=128, sliding_window=True
    )
    assert (picked.write.name, picked.decode.name, picked.extend.name) == ("triton",) * 3
    monkeypatch.setenv("TOKENSPEED_KERNEL_ATTENTION_DECODE", "reference")
    forced = PagedAttentionBackend.select(
        platform="cuda", dtype=torch.bfloat16, head_dim=128, sliding_window=True
    )
    assert (forced.decode.name, forced.extend.name) == ("reference", "triton")


# --- norm, rope, activation ------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_residual_and_on_strided_heads(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    weight = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    normed, summed = rms_norm_triton(x, weight, 1e-6, residual)
    ref_normed, ref_summed = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=TOL[dtype], atol=TOL[dtype])
    heads = torch.randn(5, 6 * 16, generator=gen).to(dtype)[:, :64].view(5, 4, 16)  # per-head q-norm
    head_weight = (torch.rand(16, generator=gen) + 0.5).to(dtype)
    torch.testing.assert_close(
        rms_norm_triton(heads, head_weight, 1e-6),
        rms_norm_reference(heads, head_weight, 1e-6),
        rtol=TOL[dtype],
        atol=TOL[dtype],
    )


@interpreted
@pytest.mark.parametrize(("dtype", "rotary_half"), [(torch.float32, 8), (torch.float16, 6)])
def test_rope_in_place_matches_reference(dtype: torch.dtype, rotary_half: int) -> None:
    """Full and partial rotary (rotary_dim 12 of 16) on q/k views of a fused QKV output."""
    gen = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos = torch.randn(64, rotary_half, generator=gen)
    sin = torch.randn(64, rotary_half, generator=gen)
    positions = torch.tensor([0, 63, 7, 7, 30])
    want_q, want_k = apply_rope_reference(q.clone(), k.clone(), positions, cos, sin)
    got_q, got_k = apply_rope_triton(q, k, positions, cos, sin)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, rtol=TOL[dtype], atol=TOL[dtype])


@interpreted
@pytest.mark.parametrize(
    ("dtype", "rotary_half", "norm"), [(torch.float32, 8, False), (torch.float16, 6, False), (torch.float16, 8, True),
                                       (torch.float32, 6, True)]
)
def test_rope_write_matches_norm_rope_and_store_one_after_the_other(
    dtype: torch.dtype, rotary_half: int, norm: bool
) -> None:
    """The fused kernel against q/k norm, RoPE and the K/V store run in turn: partial rotary (12 of 16
    channels), Qwen3's per-head norms, padding slots (-1) left untouched, q rotated in place."""
    gen = torch.Generator().manual_seed(6)
    tokens, heads, kv_heads, dim, page_size = 5, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    cos = torch.randn(64, rotary_half, generator=gen)
    sin = torch.randn(64, rotary_half, generator=gen)
    positions = torch.tensor([0, 63, 7, 7, 30])
    slots = torch.tensor([5, -1, 0, 9, 3], dtype=torch.int32)
    weights = {}
    if norm:
        weights = {"q_norm_weight": (torch.rand(dim, generator=gen) + 0.5).to(dtype),
                   "k_norm_weight": (torch.rand(dim, generator=gen) + 0.5).to(dtype), "norm_eps": 1e-6}
    caches = [torch.full((4, page_size, kv_heads, dim), 7.0, dtype=dtype) for _ in range(4)]
    want_q = rope_write_reference(q.clone(), k.clone(), v.clone(), positions, cos, sin, caches[2], caches[3], slots,
                                  **weights)
    got_q = rope_write_triton(q, k, v, positions, cos, sin, caches[0], caches[1], slots, **weights)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    if norm:  # the norm's sum of squares runs in another order: a last-bit rounding may differ
        torch.testing.assert_close(got_q, want_q, rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(caches[0], caches[2], rtol=TOL[dtype], atol=TOL[dtype])
    else:
        assert torch.equal(got_q, want_q) and torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    untouched = torch.ones(4 * page_size, dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    assert bool((caches[0].view(-1, kv_heads, dim)[untouched] == 7.0).all())


@interpreted
@pytest.mark.parametrize(("dtype", "d"), [(torch.float32, 40), (torch.float16, 1100)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, d: int) -> None:
    x = torch.randn(3, 2, 2 * d, generator=torch.Generator().manual_seed(d)).to(dtype)
    torch.testing.assert_close(
        silu_and_mul_triton(x), silu_and_mul_reference(x), rtol=TOL[dtype], atol=TOL[dtype]
    )


# --- sampling --------------------------------------------------------------------------------

SAMPLING_ROWS = [
    # temperature, top_k, top_p, min_p
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 8, 0.9, 0.05),
    (1.0, 0, 1.0, 0.1),
    (0.5, 3, 0.3, 0.2),
]


def _params(rows: list[tuple[float, int, float, float]]) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows], dtype=torch.int32),
        torch.tensor([r[2] for r in rows]),
        torch.tensor([r[3] for r in rows]),
    )


@interpreted
def test_threshold_search_keeps_exactly_the_reference_set() -> None:
    logits = torch.randn(len(SAMPLING_ROWS), 40, generator=torch.Generator().manual_seed(8)) * 2
    thresholds = kept_threshold_bits(logits, *_params(SAMPLING_ROWS))
    for row, (temperature, top_k, top_p, min_p) in enumerate(SAMPLING_ROWS):
        q = torch.exp2((logits[row] - logits[row].max()) * (LOG2E / temperature))
        kept = q.view(torch.int32) >= thresholds[row]
        probs = torch.softmax(logits[row] / temperature, dim=-1)
        assert torch.equal(kept, filter_probs_reference(probs, top_k, top_p, min_p) > 0), row


@interpreted
def test_sampler_is_keyed_greedy_exact_and_stays_in_the_kept_set() -> None:
    gen = torch.Generator().manual_seed(9)
    vocab = 1100  # two blocks per pass
    logits = torch.randn(3, vocab, generator=gen) * 3
    logits[0, 1050] = 50.0  # greedy row: its max lies in the second block
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (0.8, 0, 0.5, 0.0)]
    params = _params(rows)
    seeds, indices = torch.tensor([5, 6, 7]), torch.tensor([0, 3, 9])
    tokens = sample_triton(logits, *params, seeds, indices)
    assert int(tokens[0]) == 1050
    for row in (1, 2):
        temperature, top_k, top_p, min_p = rows[row]
        probs = filter_probs_reference(torch.softmax(logits[row] / temperature, -1), top_k, top_p, min_p)
        assert probs[tokens[row]] > 0
    # Same keys in another batch order: same tokens.
    flipped = sample_triton(logits.flip(0), *(p.flip(0) for p in params), seeds.flip(0), indices.flip(0))
    assert torch.equal(flipped.flip(0), tokens)


def test_reference_sampler_draws_what_the_python_sampler_draws() -> None:
    from tokenspeed.executor.sampler import Sampler, SampleSpec
    from tokenspeed.scheduler.sampling_params import SamplingParams

    logits = torch.randn(len(SAMPLING_ROWS), 50, generator=torch.Generator().manual_seed(12))
    seeds, indices = torch.arange(len(SAMPLING_ROWS)) * 1000 + 17, torch.arange(len(SAMPLING_ROWS)) + 3
    tokens = sample_reference(logits, *_params(SAMPLING_ROWS), seeds, indices)
    for row, (temperature, top_k, top_p, min_p) in enumerate(SAMPLING_ROWS):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        spec = SampleSpec(params, int(seeds[row]), int(indices[row]), [], [])
        assert int(tokens[row]) == Sampler()(logits[row : row + 1], [spec]).token_ids[0]


def test_device_side_seed_mix_equals_the_host_mix() -> None:
    from tokenspeed.kernels.sampling.keys import mix_seed, mix_seeds

    seeds = torch.tensor([0, 1, 2**62, 12345678901234, 2**63 - 1])
    indices = torch.tensor([0, 5, 7, 2**40, 3])
    mixed = mix_seeds(seeds, indices).tolist()
    assert mixed == [mix_seed(s, i) for s, i in zip(seeds.tolist(), indices.tolist())]
