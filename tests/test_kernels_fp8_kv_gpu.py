"""FP8 (e4m3) KV cache in the Triton kernels on a CUDA GPU at serving shapes (`pytest -m gpu`).

GQA: Llama-3.1-8B attention (32 query / 8 kv heads x 128, bf16 queries),
pages of 16 and 64, contexts up to 32K (decode) and 30K (extend), per-head
and per-tensor scales; MLA: DeepSeek-V3 dims (latent 512 + rope 64, 16 and
128 heads, pages of 64). Writes are compared bit for bit with the reference
(the hardware cast and `quant/fp8_cast.to_fp8` must agree, over every e4m3
value, the midpoints between them and wide noise); reads with the fp32
reference on the same fp8 cache, at the bf16 kernels' tolerances (the
dequantisation is exact in bf16, the scales are folded in fp32). The decode
step (write + attend) is captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

pytest.importorskip("triton")

from tests.paged_kernels import capture_cuda_graph, shuffled_page_table  # noqa: E402
from tokenspeed.kernels.attention.decode_plan import fp8_launch_candidates  # noqa: E402
from tokenspeed.kernels.attention.decode_triton import decode_attention_triton  # noqa: E402
from tokenspeed.kernels.attention.extend_triton import extend_attention_triton  # noqa: E402
from tokenspeed.kernels.attention.paged_reference import (  # noqa: E402
    decode_attention_reference,
    extend_attention_reference,
)
from tokenspeed.kernels.kvstore.reference import write_kv_reference  # noqa: E402
from tokenspeed.kernels.kvstore.write_triton import write_kv_triton  # noqa: E402
from tokenspeed.kernels.mla.decode_triton import mla_decode_triton  # noqa: E402
from tokenspeed.kernels.mla.extend_triton import mla_extend_triton  # noqa: E402
from tokenspeed.kernels.mla.reference import (  # noqa: E402
    mla_decode_reference,
    mla_extend_reference,
    mla_write_reference,
)
from tokenspeed.kernels.mla.write_triton import mla_write_triton  # noqa: E402
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, quantize_kv  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
SCALE = DIM**-0.5
BF16 = torch.bfloat16
ATTN_TOL = {"rtol": 2e-2, "atol": 1.5e-2}
LATENT, ROPE = 512, 64


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _scales(per_head: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = KV_HEADS if per_head else 1
    return (torch.rand(n, generator=gen) * 0.02 + 0.005).cuda(), (
        torch.rand(n, generator=gen) * 0.02 + 0.005
    ).cuda()


def _fp8_paged_kv(
    lengths: list[int], page_size: int, per_head: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 caches quantised with random per-head (or one) scales, each row on its own shuffled pages."""
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=4)
    k_scale, v_scale = _scales(per_head, gen)
    shape = (num_pages, page_size, KV_HEADS, DIM)
    k8 = quantize_kv(torch.randn(shape, generator=gen).cuda(), k_scale)
    v8 = quantize_kv(torch.randn(shape, generator=gen).cuda(), v_scale)
    return k8, v8, table.cuda(), k_scale, v_scale


def _interesting_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours and their fp32 neighbours, wide noise."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(float("-inf")))
    noise = torch.cat([torch.randn(8192) * s for s in (1e-3, 3e-2, 1.0, 60.0, 2e3)])
    values = torch.cat([codes, mids, up, down, noise, torch.tensor([500.0, -500.0, 0.0, -0.0, -1e-4])])
    return values[: values.numel() // (2 * DIM) * (2 * DIM)].view(-1, 2, DIM)


@pytest.mark.parametrize("scales", ["none", "per-head"])
def test_kv_write_is_bit_exact_over_every_fp8_value(scales: str) -> None:
    values = _interesting_values().cuda()  # [tokens, 2 heads, DIM]
    tokens = values.shape[0]
    k_scale = v_scale = None
    if scales == "per-head":
        k_scale, v_scale = torch.tensor([1.0, 0.25], device="cuda"), torch.tensor([4.0, 0.5], device="cuda")
    slots = torch.arange(tokens, device="cuda")
    caches = [torch.zeros(tokens // 16 + 1, 16, 2, DIM, dtype=FP8_DTYPE, device="cuda") for _ in range(4)]
    write_kv_triton(values, -values, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    write_kv_reference(values, -values, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bits(caches[0]), _bits(caches[2])) and torch.equal(_bits(caches[1]), _bits(caches[3]))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("per_head", [True, False])
def test_decode_on_fp8_long_contexts(page_size: int, per_head: bool) -> None:
    gen = torch.Generator().manual_seed(page_size + per_head)
    lengths = [1, 17, 1000, 4096, 8191, 32768, 0, 20000]
    k8, v8, table, k_scale, v_scale = _fp8_paged_kv(lengths, page_size, per_head, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    args = (q, k8, v8, table, seq_lens)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = decode_attention_reference(*args, scale=SCALE, **scales).float()
    for splits in (None, 1, 16):
        out = decode_attention_triton(*args, scale=SCALE, num_splits=splits, **scales)
        torch.testing.assert_close(out.float(), expected, **ATTN_TOL)
    assert bool((out[6] == 0).all())
    for launch in fp8_launch_candidates((DIM,)):  # every launch its tuner may pick
        out = decode_attention_triton(*args, scale=SCALE, launch=launch, **scales)
        torch.testing.assert_close(out.float(), expected, **ATTN_TOL)
        if launch.page_list:  # one split a row: the 32K row crosses many chunks of listed pages
            listed = decode_attention_triton(*args, scale=SCALE, num_splits=1, launch=launch, **scales)
            looked_up = replace(launch, page_list=False)
            torch.testing.assert_close(listed, decode_attention_triton(*args, scale=SCALE, num_splits=1,
                                                                       launch=looked_up, **scales), rtol=0, atol=0)


def test_fp8_decode_step_replays_in_a_cuda_graph() -> None:
    gen = torch.Generator().manual_seed(1)
    rows, page_size, max_len = 8, 16, 4096
    k8, v8, _, k_scale, v_scale = _fp8_paged_kv([max_len] * rows, page_size, True, gen)
    max_pages = max_len // page_size
    q = torch.zeros(rows, HEADS, DIM, dtype=BF16, device="cuda")
    new_k = torch.zeros(rows, KV_HEADS, DIM, dtype=BF16, device="cuda")
    new_v = torch.zeros_like(new_k)
    slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    table = torch.zeros(rows, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(rows, dtype=torch.int32, device="cuda")
    scales = dict(k_scale=k_scale, v_scale=v_scale)

    def step() -> torch.Tensor:
        write_kv_triton(new_k, new_v, k8, v8, slots, **scales)
        return decode_attention_triton(q, k8, v8, table, seq_lens, scale=SCALE, num_splits=8, **scales)

    graph, out = capture_cuda_graph(step)
    for trial in range(3):
        lengths = torch.randint(1, max_len + 1, (rows - trial,), generator=gen).tolist() + [0] * trial
        perm = torch.randperm(k8.shape[0], generator=gen)[: rows * max_pages].view(rows, max_pages)
        table.copy_(perm.to(torch.int32))
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(rows, HEADS, DIM, generator=gen).to(BF16))
        new_k.copy_(torch.randn(rows, KV_HEADS, DIM, generator=gen).to(BF16))
        new_v.copy_(torch.randn(rows, KV_HEADS, DIM, generator=gen).to(BF16))
        slots.copy_(
            torch.tensor(
                [
                    int(perm[r, (n - 1) // page_size]) * page_size + (n - 1) % page_size if n else -1
                    for r, n in enumerate(lengths)
                ]
            )
        )
        k_before, v_before = k8.clone(), v8.clone()
        graph.replay()
        write_kv_reference(new_k, new_v, k_before, v_before, slots, **scales)
        assert torch.equal(_bits(k8), _bits(k_before)) and torch.equal(_bits(v8), _bits(v_before))
        expected = decode_attention_reference(q, k8, v8, table, seq_lens, scale=SCALE, **scales)
        torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL)


@pytest.mark.parametrize("page_size", [16, 64])
def test_extend_on_fp8_mixed_batch(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size + 7)
    rows = [(2048, 2048), (512, 30000), (1, 5000), (0, 100), (64, 9000)]  # (new tokens, kv length)
    k8, v8, table, k_scale, v_scale = _fp8_paged_kv([n for _, n in rows], page_size, True, gen)
    q_lens = torch.tensor([t for t, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(int(q_lens.sum()), HEADS, DIM, generator=gen).to(BF16).cuda()
    args = (q, k8, v8, query_start, seq_lens, table)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = extend_attention_triton(*args, scale=SCALE, max_query_len=2048, **scales)
    expected = extend_attention_reference(*args, scale=SCALE, **scales)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL)


def _mla_fp8_cache(
    lengths: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 latent cache with pages of 64, page table, scale [1]), written through the Triton write."""
    table, num_pages = shuffled_page_table(lengths, 64, gen, spare_pages=4)
    scale = torch.tensor([0.01], device="cuda")
    cache = torch.zeros(num_pages, 64, 1, LATENT + ROPE, dtype=FP8_DTYPE, device="cuda")
    rows = torch.randn(num_pages * 64, LATENT + ROPE, generator=gen).cuda()
    slots = torch.arange(num_pages * 64, device="cuda")
    mla_write_triton(rows, cache, slots, kv_scale=scale)
    reference = torch.zeros_like(cache)
    mla_write_reference(rows, reference, slots, kv_scale=scale)
    assert torch.equal(_bits(cache), _bits(reference))
    return cache, table.cuda(), scale


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_on_fp8(heads: int, q_len: int) -> None:
    gen = torch.Generator().manual_seed(heads + q_len)
    lengths = [1, 17, 1000, 4096, 8191, 0, 3, 8192]
    cache, table, scale = _mla_fp8_cache(lengths, gen)
    q = torch.randn(len(lengths) * q_len, heads, LATENT + ROPE, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kwargs = dict(q_len=q_len, scale=192**-0.5, kv_lora_rank=LATENT, kv_scale=scale)
    expected = mla_decode_reference(q, cache, table, seq_lens, **kwargs).float()
    for splits in (None, 1, 13):
        out = mla_decode_triton(q, cache, table, seq_lens, num_splits=splits, **kwargs)
        torch.testing.assert_close(out.float(), expected, **ATTN_TOL)


def test_mla_extend_on_fp8() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [(1024, 1024), (256, 6000), (1, 700)]
    cache, table, scale = _mla_fp8_cache([n for _, n in rows], gen)
    q_lens = torch.tensor([t for t, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(int(q_lens.sum()), 128, LATENT + ROPE, generator=gen).to(BF16).cuda()
    kwargs = dict(scale=192**-0.5, kv_lora_rank=LATENT, kv_scale=scale)
    out = mla_extend_triton(q, cache, query_start, seq_lens, table, max_query_len=1024, **kwargs)
    expected = mla_extend_reference(q, cache, query_start, seq_lens, table, **kwargs)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL)
