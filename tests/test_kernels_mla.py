"""MLA kernels (`tokenspeed.kernels.mla`) on the CPU: references against dense attention, Triton against references.

The references are checked against the most literal computation there is:
each row's latent keys are generated densely, placed into shuffled pages one
position at a time, and every (token, head) output is a softmax over the
dense prefix slice it may see. The Triton kernels then run under Triton's
interpreter (TRITON_INTERPRET=1 is set before triton is first imported, by
`tests/triton_interpreter.py`; if triton was already imported compiled, the file
reruns in a fresh process) with tiny shapes in fp32 and fp16: latent 32, rope
16, 4 heads, page sizes 4..16, q_len 1..4, ragged rows including padding
rows, rows shorter than q_len and lengths that are not page multiples.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.mla.decode_plan import DecodeLaunch, choose_fold, choose_num_splits, default_launch
from tokenspeed.kernels.mla.decode_triton import mla_decode_triton
from tokenspeed.kernels.mla.extend_triton import mla_extend_triton
from tokenspeed.kernels.mla.reference import (
    mla_decode_reference,
    mla_extend_reference,
    mla_write_reference,
)
from tokenspeed.kernels.mla.write_triton import mla_write_triton
from tokenspeed.kernels.registry import Band, select_kernel

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}

LATENT, ROPE, HEADS = 32, 16, 4
SCALE = (LATENT + ROPE) ** -0.5


def _dense_rows(lengths: list[int], dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(n, LATENT + ROPE, generator=gen).to(dtype) for n in lengths]


def _paged(
    dense: list[torch.Tensor], page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding each row on its own shuffled pages (filled with noise elsewhere) and its page table."""
    need = [-(-len(rows) // page_size) for rows in dense]
    num_pages = sum(need) + 2
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(dense), max(max(need), 1), dtype=torch.int32)
    cache = torch.randn(num_pages, page_size, 1, LATENT + ROPE, generator=gen).to(dense[0].dtype)
    used = 0
    for row, keys in enumerate(dense):
        table[row, : need[row]] = order[used : used + need[row]]
        used += need[row]
        for pos in range(len(keys)):
            cache[int(table[row, pos // page_size]), pos % page_size, 0] = keys[pos]
    return cache, table


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """q `[n, H, Dl+Dr]` at the given positions over dense keys `[S, Dl+Dr]`: `[n, H, Dl]` fp32."""
    out = torch.zeros(q.shape[0], q.shape[1], LATENT)
    for i, pos in enumerate(positions):
        if pos < 0:
            continue
        seen = keys[: pos + 1].float()
        probs = torch.softmax(q[i].float() @ seen.T * SCALE, dim=-1)
        out[i] = probs @ seen[:, :LATENT]
    return out


def _decode_case(
    lengths: list[int], q_len: int, page_size: int, dtype: torch.dtype, seed: int, heads: int = HEADS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, cache, table, seq_lens, dense expectation) for a decode batch of `q_len` tokens per row."""
    gen = torch.Generator().manual_seed(seed)
    dense = _dense_rows(lengths, dtype, gen)
    cache, table = _paged(dense, page_size, gen)
    q = torch.randn(len(lengths) * q_len, heads, LATENT + ROPE, generator=gen).to(dtype)
    expected = torch.cat(
        [
            _dense_attention(q[r * q_len : (r + 1) * q_len], keys, [n - q_len + j for j in range(q_len)])
            for r, (n, keys) in enumerate(zip(lengths, dense))
        ]
    )
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32), expected


DECODE_LENGTHS = [37, 0, 1, 61, 16]  # ragged; 0 is a padding row, 1 is shorter than q_len > 1


@pytest.mark.parametrize(("q_len", "page_size"), [(1, 4), (2, 16), (3, 8), (4, 4)])
def test_decode_reference_matches_dense_attention(q_len: int, page_size: int) -> None:
    q, cache, table, seq_lens, expected = _decode_case(DECODE_LENGTHS, q_len, page_size, torch.float32, q_len)
    out = mla_decode_reference(q, cache, table, seq_lens, q_len=q_len, scale=SCALE, kv_lora_rank=LATENT)
    assert out.shape == (len(DECODE_LENGTHS) * q_len, HEADS, LATENT) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert bool((out[q_len : 2 * q_len] == 0).all())  # the padding row


def _extend_case(
    rows: list[tuple[int, int]], page_size: int, dtype: torch.dtype, seed: int, heads: int = HEADS
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, cache, query_start, seq_lens, table), dense expectation) for (new tokens, kv length) rows."""
    gen = torch.Generator().manual_seed(seed)
    dense = _dense_rows([n for _, n in rows], dtype, gen)
    cache, table = _paged(dense, page_size, gen)
    q_lens = torch.tensor([n for n, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), heads, LATENT + ROPE, generator=gen).to(dtype)
    parts = [
        _dense_attention(q[int(query_start[r]) : int(query_start[r + 1])], keys, list(range(n - new, n)))
        for r, ((new, n), keys) in enumerate(zip(rows, dense))
    ]
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    return (q, cache, query_start, seq_lens, table), torch.cat(parts)


# (new tokens, kv length): fresh prompt, decode row, empty row, chunk after a cached prefix
EXTEND_ROWS = [(20, 20), (1, 9), (0, 4), (18, 45)]


@pytest.mark.parametrize("page_size", [4, 16])
def test_extend_reference_matches_dense_attention(page_size: int) -> None:
    args, expected = _extend_case(EXTEND_ROWS, page_size, torch.float32, page_size)
    out = mla_extend_reference(*args, scale=SCALE, kv_lora_rank=LATENT, max_query_len=20)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_write_reference_stores_rows_and_skips_padding_slots() -> None:
    gen = torch.Generator().manual_seed(7)
    page_size, tokens = 4, 6
    cache = torch.full((5, page_size, 1, LATENT + ROPE), 7.0)
    rows = torch.randn(tokens + 2, LATENT + ROPE, generator=gen)[1:-1]  # a strided-offset view
    slots = torch.tensor([19, -1, 0, 9, -1, 2])
    mla_write_reference(rows, cache, slots)
    flat = cache.view(-1, LATENT + ROPE)
    written = slots[slots >= 0]
    assert torch.equal(flat[written], rows[slots >= 0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert bool((flat[untouched] == 7.0).all())
    before = cache.clone()
    mla_write_reference(rows[:2], cache, torch.tensor([-1, -1]))  # a batch of padding only
    assert torch.equal(cache, before)


def test_references_are_selected_on_cpu_and_registered_for_cuda() -> None:
    for mode in ("write", "decode", "extend"):
        spec = select_kernel("mla", mode, platform="cpu", dtype=torch.float32)
        assert spec.name == "reference" and spec.band == Band.REFERENCE
        assert "cuda" in spec.platforms


# --- Triton kernels under the interpreter ------------------------------------------------------


test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, slow=True)


DECODE_CASES = [
    # dtype, q_len, page_size, fold, num_splits
    (torch.float32, 1, 4, None, 1),  # plain decode, one pass
    (torch.float16, 1, 16, None, 3),  # plain decode, split-KV
    (torch.float32, 2, 8, None, 2),  # folded pair (4 heads x 2 tokens)
    (torch.float16, 4, 4, None, 1),  # folded 4 tokens, one pass
    (torch.float16, 4, 16, 1, 2),  # the same unfolded, split
    (torch.float16, 3, 8, 3, 4),  # odd q_len folded, more splits than some rows have blocks
    (torch.float32, 4, 4, 2, 1),  # partial fold: two programs of two tokens per row
    (torch.float32, 5, 4, 3, 1),  # ragged fold: 3 + 2 tokens, the short group's missing rows masked
    (torch.float16, 5, 8, 2, 3),  # ragged fold 2 + 2 + 1, split
]


SOFTMAX_FORMS = {"online": DecodeLaunch(16, 4, 2), "anchored": DecodeLaunch(16, 4, 2, anchored=True)}


@interpreted
@pytest.mark.parametrize("softmax", list(SOFTMAX_FORMS))
@pytest.mark.parametrize(("dtype", "q_len", "page_size", "fold", "num_splits"), DECODE_CASES)
def test_decode_triton_matches_reference(
    dtype: torch.dtype, q_len: int, page_size: int, fold: int | None, num_splits: int, softmax: str
) -> None:
    """The online and the anchored softmax on every case."""
    q, cache, table, seq_lens, _ = _decode_case(DECODE_LENGTHS, q_len, page_size, dtype, 10 + q_len)
    kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}
    launch = SOFTMAX_FORMS[softmax]
    out = mla_decode_triton(
        q, cache, table, seq_lens, num_splits=num_splits, fold=fold, launch=launch, **kwargs
    )
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert bool((out[q_len : 2 * q_len] == 0).all())  # padding row


@interpreted
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the first walk overflows, by design
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_anchored_softmax_walks_again_when_a_later_score_towers_over_the_first_tile(
    dtype: torch.dtype,
) -> None:
    """A key far past the first tile scoring ~150 (base 2) above it: exp2 would overflow at the first-tile anchor.

    The kernel must notice and redo the range with the row's true max; the
    result is then (nearly) that key's latent for the head aimed at it, and
    the other heads are unaffected.
    """
    q, cache, table, seq_lens, _ = _decode_case(DECODE_LENGTHS, 1, 4, dtype, 21)
    row, position, head = 3, DECODE_LENGTHS[3] - 3, 1
    page, slot = int(table[row, position // 4]), position % 4
    aim = q[row, head].float() / q[row, head].float().norm()
    cache[page, slot, 0] = (100.0 * aim).to(dtype)
    kwargs = {"q_len": 1, "scale": SCALE, "kv_lora_rank": LATENT}
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs)
    assert float(expected[row, head].float().sub(cache[page, slot, 0, :LATENT].float()).abs().max()) < 1e-2
    for num_splits in (1, 2):
        out = mla_decode_triton(
            q, cache, table, seq_lens, num_splits=num_splits, launch=SOFTMAX_FORMS["anchored"], **kwargs
        )
        assert bool(torch.isfinite(out).all())
        torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@interpreted
def test_decode_triton_strided_query_and_int64_tables() -> None:
    """q as a view of a wider projection output; the executor's tables may be int64."""
    gen = torch.Generator().manual_seed(3)
    q_len, lengths = 2, [9, 23]
    dense = _dense_rows(lengths, torch.float32, gen)
    cache, table = _paged(dense, 4, gen)
    wide = torch.randn(len(lengths) * q_len, HEADS, LATENT + ROPE + 8, generator=gen)
    q = wide[:, :, 4 : 4 + LATENT + ROPE]
    seq_lens = torch.tensor(lengths)
    kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}
    out = mla_decode_triton(q, cache, table.long(), seq_lens, num_splits=2, **kwargs)
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@interpreted
@pytest.mark.parametrize(("heads", "q_len", "num_splits"), [(6, 2, 2), (72, 1, 1)])
def test_triton_odd_head_counts_and_several_head_blocks(heads: int, q_len: int, num_splits: int) -> None:
    """6 heads: a partly empty tile (folded 2 x 6 rows of 16; 8-head blocks in extend).

    72 heads: two 64-head blocks, the second mostly empty, so head offsets of the second block count.
    """
    lengths = [9, 20]
    q, cache, table, seq_lens, expected = _decode_case(lengths, q_len, 8, torch.float32, heads, heads)
    kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}
    out = mla_decode_triton(q, cache, table, seq_lens, num_splits=num_splits, **kwargs)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    args, expected = _extend_case([(3, 9), (2, 20)], 8, torch.float32, heads, heads)
    out = mla_extend_triton(*args, scale=SCALE, kv_lora_rank=LATENT, max_query_len=3)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@interpreted
@pytest.mark.parametrize(("dtype", "page_size"), [(torch.float32, 4), (torch.float16, 16)])
def test_extend_triton_matches_reference(dtype: torch.dtype, page_size: int) -> None:
    args, _ = _extend_case(EXTEND_ROWS, page_size, dtype, 20 + page_size)
    kwargs = {"scale": SCALE, "kv_lora_rank": LATENT}
    out = mla_extend_triton(*args, max_query_len=20, **kwargs)
    expected = mla_extend_reference(*args, **kwargs)
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@interpreted
def test_write_triton_matches_reference() -> None:
    gen = torch.Generator().manual_seed(8)
    caches = [torch.full((5, 4, 1, LATENT + ROPE), 7.0, dtype=torch.float16) for _ in range(2)]
    rows = torch.randn(6, LATENT + ROPE + 4, generator=gen)[:, :-4]  # fp32 rows, strided, into fp16
    slots = torch.tensor([19, -1, 0, 9, -1, 2], dtype=torch.int32)
    mla_write_triton(rows, caches[0], slots)
    mla_write_reference(rows, caches[1], slots)
    assert torch.equal(caches[0], caches[1])


def test_long_splits_of_narrow_tiles_take_the_anchored_softmax() -> None:
    """Latency-bound short splits stay online, as do 64-row (wgmma) tiles, where the anchored form measured slower."""
    bf16 = torch.bfloat16
    assert default_launch(16, bf16, 64) == DecodeLaunch(32, 4, 2)
    assert default_launch(16, bf16, 4096) == DecodeLaunch(64, 4, 2, anchored=True)
    assert default_launch(16, bf16) == default_launch(16, bf16, 4096)
    assert default_launch(32, bf16, 4096).anchored and not default_launch(32, bf16, 128).anchored
    assert not default_launch(64, bf16, 65536).anchored


def test_fold_and_split_heuristics() -> None:
    assert [choose_fold(16, q) for q in (1, 2, 3, 4, 5, 6, 8, 16)] == [1, 2, 3, 4, 3, 3, 4, 4]  # 5: 3 + 2
    assert [choose_fold(128, q) for q in (1, 4)] == [1, 1]  # 128 heads overfill one tile already
    assert choose_fold(16, 4, block_h=32) == 2
    # one long row spreads over the SMs (16-row tiles: 2 per SM, 264 slots), capped at 128 splits
    assert 100 <= choose_num_splits(1, 16, 1, 65536, device="cpu") <= 128
    assert choose_num_splits(1, 16, 1, 1 << 20, device="cpu") <= 128
    assert choose_num_splits(64, 16, 1, 65536, device="cpu") == 4  # 256 programs fill the 264 slots
    assert choose_num_splits(1, 16, 1, 100, device="cpu") == 1  # too short to be worth splitting
    assert choose_num_splits(1, 16, 1, 4096, device="cpu") >= 32  # bs1 short context: 64-token splits
    # folded, a row's 4 tokens are one 64-row program (one per SM): 8 x 16 = 128 programs, not 8 x 17 =
    # 136, which would need a second wave for 4 programs; unfolded, four 16-row programs (two per SM)
    assert choose_num_splits(8, 16, 4, 16384, device="cpu") == 16
    assert choose_num_splits(8, 16, 4, 16384, fold=1, device="cpu") == 8
    assert choose_num_splits(64, 128, 1, 4096, device="cpu") == 1  # 128 programs already fill the GPU


def test_triton_kernels_are_chosen_on_cuda() -> None:
    for mode in ("write", "decode", "extend"):
        spec = select_kernel("mla", mode, platform="cuda", dtype=torch.bfloat16)
        assert spec.name == "triton" and spec.band == Band.PORTABLE
