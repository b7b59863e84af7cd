"""MLA Triton kernels against the torch references on a CUDA GPU, at DeepSeek-V3 dims (`pytest -m gpu`).

bf16, latent 512 + rope 64, 16 heads (Moonlight, V3 at TP8) and 128 heads
(V3 at TP1), pages of 16 and 64 tokens, q_len 1/2/4/8 (decode and speculative
verification), contexts up to 8K including padding rows and rows shorter than
q_len. Decode runs folded and unfolded and with several split counts, and is
captured in a CUDA graph together with the cache write (the reference write
too: it promises to need no host sync) and replayed with new lengths/tables.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests.paged_kernels import capture_cuda_graph, shuffled_page_table  # noqa: E402
from tokenspeed.kernels.mla.reference import (  # noqa: E402
    mla_decode_reference,
    mla_extend_reference,
    mla_write_reference,
)

pytest.importorskip("triton")

from tokenspeed.kernels.mla.decode_plan import DecodeLaunch, choose_num_splits  # noqa: E402
from tokenspeed.kernels.mla.decode_triton import mla_decode_triton  # noqa: E402
from tokenspeed.kernels.mla.extend_triton import mla_extend_triton  # noqa: E402
from tokenspeed.kernels.mla.write_triton import mla_write_triton  # noqa: E402

LATENT, ROPE = 512, 64
SCALE = 192**-0.5  # DeepSeek scales by the full q/k head dim (128 nope + 64 rope)
BF16 = torch.bfloat16
TOL = {"rtol": 2e-2, "atol": 1.5e-2}


def _paged_cache(
    lengths: list[int], page_size: int, gen: torch.Generator, spare_pages: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 latent cache on the GPU with each row on its own shuffled pages; int32 table padded with 0."""
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages)
    cache = torch.randn(num_pages, page_size, 1, LATENT + ROPE, generator=gen).to(BF16).cuda()
    return cache, table.cuda()


@pytest.mark.parametrize("q_len", [1, 2, 4, 5, 8])  # 5 at 16 heads: a ragged fold (3 + 2)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_matches_reference(heads: int, page_size: int, q_len: int) -> None:
    gen = torch.Generator().manual_seed(heads + page_size + q_len)
    lengths = [1, 17, 1000, 4096, 8191, 0, 3, 8192]  # 0: padding row; 1 and 3 may be shorter than q_len
    cache, table = _paged_cache(lengths, page_size, gen)
    q = torch.randn(len(lengths) * q_len, heads, LATENT + ROPE, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs).float()
    for fold, splits in ((None, None), (None, 1), (1, None), (None, 13)):
        out = mla_decode_triton(q, cache, table, seq_lens, fold=fold, num_splits=splits, **kwargs)
        torch.testing.assert_close(
            out.float(),
            expected,
            **TOL,
            msg=lambda m, fold=fold, splits=splits: f"fold={fold} splits={splits}: {m}",
        )
    assert bool((out[5 * q_len : 6 * q_len] == 0).all())


@pytest.mark.parametrize(
    "launch",
    [DecodeLaunch(16, 4, 4), DecodeLaunch(32, 8, 2), DecodeLaunch(64, 8, 2), DecodeLaunch(64, 4, 3)]
    + [DecodeLaunch(32, 4, 2, anchored=True), DecodeLaunch(64, 4, 2, anchored=True)]
    + [DecodeLaunch(64, 8, 3, anchored=True), DecodeLaunch(16, 4, 3, anchored=True)],
)
def test_decode_launch_variants_stay_correct(launch: DecodeLaunch) -> None:
    """Configurations like those `benchmarks/mla_kernels.py --sweep` times, both softmax forms, so a retuned default is tested.

    A configuration that does not fit the chip (shared memory) may refuse to launch; it must not miscompute.
    """
    gen = torch.Generator().manual_seed(launch.block_n + launch.num_warps)
    lengths = [100, 4097, 0, 8000]
    cache, table = _paged_cache(lengths, 64, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for heads, q_len in ((16, 1), (16, 4), (128, 1)):
        q = torch.randn(len(lengths) * q_len, heads, LATENT + ROPE, generator=gen).to(BF16).cuda()
        kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}
        try:
            out = mla_decode_triton(q, cache, table, seq_lens, num_splits=5, launch=launch, **kwargs)
        except Exception as exc:  # triton's OutOfResources: too much shared memory for this chip
            if "OutOfResources" not in type(exc).__name__:
                raise
            continue
        expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs)
        torch.testing.assert_close(out.float(), expected.float(), **TOL)


@pytest.mark.parametrize("anchored", [False, True])
def test_decode_survives_a_score_far_above_the_first_tile(anchored: bool) -> None:
    """One key scoring ~150 (base 2) above the rest, 3000 positions into a 4K row (the anchored form must redo).

    bf16 exp2 of that shift against the first tile's max is inf; the result
    must still be that key's latent for the aimed head and the reference elsewhere.
    """
    gen = torch.Generator().manual_seed(5)
    lengths = [4096, 300]
    cache, table = _paged_cache(lengths, 64, gen)
    q = torch.randn(2, 16, LATENT + ROPE, generator=gen).to(BF16).cuda()
    page, slot = int(table[0, 3000 // 64]), 3000 % 64
    cache[page, slot, 0] = (60.0 * q[0, 3].float() / q[0, 3].float().norm()).to(BF16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kwargs = {"q_len": 1, "scale": SCALE, "kv_lora_rank": LATENT}
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs).float()
    torch.testing.assert_close(expected[0, 3], cache[page, slot, 0, :LATENT].float(), rtol=1e-2, atol=1e-2)
    for splits in (1, 5):
        launch = DecodeLaunch(64, 4, 2, anchored=anchored)
        out = mla_decode_triton(q, cache, table, seq_lens, num_splits=splits, launch=launch, **kwargs)
        assert bool(torch.isfinite(out).all())
        torch.testing.assert_close(out.float(), expected, **TOL)


@pytest.mark.parametrize("writer", ["triton", "reference"])
def test_write_and_decode_replay_in_a_cuda_graph(writer: str) -> None:
    """Capture once with fixed (rows, max_pages, num_splits); replay with new lengths, tables and padding."""
    write = mla_write_triton if writer == "triton" else mla_write_reference
    gen = torch.Generator().manual_seed(0)
    rows, q_len, heads, page_size, max_len = 8, 2, 16, 64, 4096
    cache, _ = _paged_cache([max_len] * rows, page_size, gen)
    max_pages = max_len // page_size
    tokens = rows * q_len
    q = torch.zeros(tokens, heads, LATENT + ROPE, dtype=BF16, device="cuda")
    new_rows = torch.zeros(tokens, LATENT + ROPE, dtype=BF16, device="cuda")
    slots = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")
    table = torch.zeros(rows, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(rows, dtype=torch.int32, device="cuda")
    splits = choose_num_splits(rows, heads, q_len, max_len, device=q.device)
    kwargs = {"q_len": q_len, "scale": SCALE, "kv_lora_rank": LATENT}

    def step() -> torch.Tensor:
        write(new_rows, cache, slots)
        return mla_decode_triton(q, cache, table, seq_lens, num_splits=splits, **kwargs)

    graph, out = capture_cuda_graph(step)

    num_pages = cache.shape[0]
    for trial in range(3):
        live = rows - 3 * trial  # the rest is padding: length 0, slots -1
        lengths = torch.randint(q_len, max_len + 1, (live,), generator=gen).tolist() + [0] * (rows - live)
        perm = torch.randperm(num_pages, generator=gen)[: rows * max_pages].view(rows, max_pages)
        table.copy_(perm.to(torch.int32))
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(tokens, heads, LATENT + ROPE, generator=gen).to(BF16))
        new_rows.copy_(torch.randn(tokens, LATENT + ROPE, generator=gen).to(BF16))
        flat = [
            int(perm[r, p // page_size]) * page_size + p % page_size if n > 0 else -1
            for r, n in enumerate(lengths)
            for p in range(n - q_len, n)
        ]
        slots.copy_(torch.tensor(flat))
        before = cache.clone()
        graph.replay()
        mla_write_reference(new_rows, before, slots)
        assert torch.equal(cache, before)
        expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs)
        torch.testing.assert_close(out.float(), expected.float(), **TOL)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_extend_mixed_batch(heads: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(heads + page_size)
    # (new tokens, kv length): fresh prompt, chunk after a long cached prefix, decode row, empty row,
    # a short chunk at 8K context
    rows = [(1024, 1024), (512, 6000), (1, 5000), (0, 100), (64, 8192)]
    cache, table = _paged_cache([n for _, n in rows], page_size, gen)
    q_lens = torch.tensor([q for q, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(int(q_lens.sum()), heads, LATENT + ROPE, generator=gen).to(BF16).cuda()
    args = (q, cache, query_start, seq_lens, table)
    out = mla_extend_triton(*args, scale=SCALE, kv_lora_rank=LATENT, max_query_len=1024)
    expected = mla_extend_reference(*args, scale=SCALE, kv_lora_rank=LATENT)
    torch.testing.assert_close(out.float(), expected.float(), **TOL)


def test_write_bf16_matches_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    caches = [torch.zeros(64, 64, 1, LATENT + ROPE, dtype=BF16, device="cuda") for _ in range(2)]
    rows = torch.randn(300, LATENT + ROPE, generator=gen).to(BF16).cuda()
    slots = torch.randperm(64 * 64, generator=gen)[:300].cuda()
    slots[::7] = -1
    mla_write_triton(rows, caches[0], slots)
    mla_write_reference(rows, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
