"""Triton kernels against their torch references on a CUDA GPU, at serving shapes (`make test-gpu`).

Shapes are Llama-3.1-8B's attention (bf16, head_dim 128, 32 query / 8 kv
heads), pages of 16 and 64 tokens, contexts up to 32K for decode and 128K for
extend. The decode kernel is also captured in a CUDA graph and replayed with
other lengths and tables, since that is how the executor runs it. The sampler
is checked in distribution (it uses Philox, not torch's generator).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests.paged_kernels import capture_cuda_graph, shuffled_page_table  # noqa: E402
from tests.staging_cases import assert_same_inputs, staged_case  # noqa: E402
from tokenspeed.kernels.activation.reference import silu_and_mul_reference  # noqa: E402
from tokenspeed.kernels.attention.paged_reference import (  # noqa: E402
    decode_attention_reference,
    extend_attention_reference,
)
from tokenspeed.kernels.kvstore.reference import rope_write_reference, write_kv_reference  # noqa: E402
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference  # noqa: E402
from tokenspeed.kernels.rope.reference import apply_rope_reference  # noqa: E402
from tokenspeed.kernels.sampling.reference import filter_probs_reference  # noqa: E402
from tokenspeed.kernels.staging.step_inputs import step_inputs_reference  # noqa: E402

pytest.importorskip("triton")

from tokenspeed.kernels.activation.silu_triton import silu_and_mul_triton  # noqa: E402
from tokenspeed.kernels.attention.decode_plan import choose_num_splits  # noqa: E402
from tokenspeed.kernels.attention.decode_triton import decode_attention_triton  # noqa: E402
from tokenspeed.kernels.attention.extend_triton import extend_attention_triton  # noqa: E402
from tokenspeed.kernels.kvstore.rope_write_triton import rope_write_triton  # noqa: E402
from tokenspeed.kernels.kvstore.write_triton import write_kv_triton  # noqa: E402
from tokenspeed.kernels.norm.rms_triton import rms_norm_triton  # noqa: E402
from tokenspeed.kernels.rope.rope_triton import apply_rope_triton  # noqa: E402
from tokenspeed.kernels.sampling.sample_triton import kept_threshold_bits, sample_triton  # noqa: E402
from tokenspeed.kernels.staging.step_inputs_triton import step_inputs_triton  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
SCALE = DIM**-0.5
BF16 = torch.bfloat16
ATTN_TOL = {"rtol": 2e-2, "atol": 1.5e-2}
LOG2E = 1.4426950408889634


def _paged_kv(
    lengths: list[int], page_size: int, gen: torch.Generator, spare_pages: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 caches on the GPU, each row on its own shuffled pages; int32 table padded with 0."""
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages)
    shape = (num_pages, page_size, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen).to(BF16).cuda()
    v_cache = torch.randn(shape, generator=gen).to(BF16).cuda()
    return k_cache, v_cache, table.cuda()


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("window", [None, 4096])
def test_decode_long_contexts(page_size: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(page_size)
    lengths = [1, 17, 1000, 4096, 8191, 32768, 0, 20000]
    k_cache, v_cache, table = _paged_kv(lengths, page_size, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, table, seq_lens)
    expected = decode_attention_reference(*args, scale=SCALE, sliding_window=window).float()
    for splits in (None, 1, 16):
        out = decode_attention_triton(*args, scale=SCALE, sliding_window=window, num_splits=splits)
        torch.testing.assert_close(out.float(), expected, **ATTN_TOL)
    assert bool((out[6] == 0).all())


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_decode_and_kv_write_replay_in_a_cuda_graph(pdl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture once with fixed (rows, max_pages, num_splits); replay with new lengths, tables and padding.
    With PDL the decode kernel reads lengths and pages and prefetches its first K/V tile before its wait,
    while the write kernel before it stores the new position (kernels/pdl.py)."""
    monkeypatch.setenv("TOKENSPEED_PDL", pdl)
    gen = torch.Generator().manual_seed(0)
    rows, page_size, max_len = 8, 16, 4096
    k_cache, v_cache, _ = _paged_kv([max_len] * rows, page_size, gen)
    max_pages = max_len // page_size
    q = torch.zeros(rows, HEADS, DIM, dtype=BF16, device="cuda")
    new_k = torch.zeros(rows, KV_HEADS, DIM, dtype=BF16, device="cuda")
    new_v = torch.zeros_like(new_k)
    slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    table = torch.zeros(rows, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(rows, dtype=torch.int32, device="cuda")
    splits = choose_num_splits(rows, KV_HEADS, max_len, q.device)

    def step() -> torch.Tensor:
        write_kv_triton(new_k, new_v, k_cache, v_cache, slots)
        return decode_attention_triton(q, k_cache, v_cache, table, seq_lens, scale=SCALE, num_splits=splits)

    graph, out = capture_cuda_graph(step)

    num_pages = k_cache.shape[0]
    for trial in range(3):
        live = rows - 2 * trial  # the rest is padding: length 0, slot -1
        lengths = torch.randint(1, max_len + 1, (live,), generator=gen).tolist() + [0] * (rows - live)
        perm = torch.randperm(num_pages, generator=gen)[: rows * max_pages].view(rows, max_pages)
        table.copy_(perm.to(torch.int32))
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(rows, HEADS, DIM, generator=gen).to(BF16))
        new_k.copy_(torch.randn(rows, KV_HEADS, DIM, generator=gen).to(BF16))
        new_v.copy_(torch.randn(rows, KV_HEADS, DIM, generator=gen).to(BF16))
        last = [n - 1 for n in lengths]
        flat = [
            int(perm[r, p // page_size]) * page_size + p % page_size if p >= 0 else -1
            for r, p in enumerate(last)
        ]
        slots.copy_(torch.tensor(flat))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        write_kv_reference(new_k, new_v, k_before, v_before, slots)
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
        expected = decode_attention_reference(q, k_cache, v_cache, table, seq_lens, scale=SCALE)
        torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("window", [None, 4096])
def test_extend_mixed_batch_up_to_128k(page_size: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(page_size + 1)
    # (new tokens, kv length): fresh prompt, chunk after a long cached prefix, decode row,
    # empty row, a chunk at 128K context
    rows = [(2048, 2048), (512, 30000), (1, 5000), (0, 100), (64, 131072)]
    k_cache, v_cache, table = _paged_kv([n for _, n in rows], page_size, gen)
    q_lens = torch.tensor([q for q, _ in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(int(q_lens.sum()), HEADS, DIM, generator=gen).to(BF16).cuda()
    args = (q, k_cache, v_cache, query_start, seq_lens, table)
    out = extend_attention_triton(*args, scale=SCALE, sliding_window=window, max_query_len=2048)
    expected = extend_attention_reference(*args, scale=SCALE, sliding_window=window)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL)


def test_kv_write_bf16_skips_padding() -> None:
    gen = torch.Generator().manual_seed(2)
    caches = [torch.zeros(64, 16, KV_HEADS, DIM, dtype=BF16, device="cuda") for _ in range(4)]
    k = torch.randn(100, KV_HEADS, DIM, generator=gen).to(BF16).cuda()
    v = torch.randn(100, KV_HEADS, DIM, generator=gen).to(BF16).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:100].cuda()
    slots[::7] = -1
    write_kv_triton(k, v, caches[0], caches[1], slots)
    write_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rms_norm_bf16() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 4096, generator=gen).to(BF16).cuda()
    residual = torch.randn(300, 4096, generator=gen).to(BF16).cuda()
    weight = (torch.rand(4096, generator=gen) + 0.5).to(BF16).cuda()
    normed, summed = rms_norm_triton(x, weight, 1e-5, residual)
    ref_normed, ref_summed = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed)
    q_heads = (
        torch.randn(300, 48 * DIM, generator=gen).to(BF16).cuda()[:, : HEADS * DIM].view(300, HEADS, DIM)
    )
    head_weight = weight[:DIM].contiguous()
    torch.testing.assert_close(
        rms_norm_triton(q_heads, head_weight, 1e-6), rms_norm_reference(q_heads, head_weight, 1e-6)
    )


@pytest.mark.parametrize("rope_type", ["default", "llama3", "yarn"])
def test_rope_bf16_every_scaling(rope_type: str) -> None:
    from tokenspeed.layers.rope_scaling import RopeConfig
    from tokenspeed.layers.rotary_embedding import RotaryEmbedding

    configs = {
        "default": RopeConfig(rope_type="default", theta=1e6),
        "llama3": RopeConfig(
            rope_type="llama3",
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        "yarn": RopeConfig(rope_type="yarn", theta=1e6, factor=4.0, original_max_position_embeddings=32768),
    }
    rotary = RotaryEmbedding(
        configs[rope_type], head_dim=DIM, max_position_embeddings=131072, dtype=BF16, device="cuda"
    )
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(500, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(BF16).cuda()
    q = qkv[:, : HEADS * DIM].view(500, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(500, KV_HEADS, DIM)
    positions = torch.randint(0, 131072, (500,), generator=gen).cuda()
    want_q, want_k = apply_rope_reference(q.clone(), k.clone(), positions, rotary.cos_cache, rotary.sin_cache)
    got_q, got_k = rotary(positions, q, k)  # the layer routes to the Triton kernel on CUDA
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_bf16_equals_norm_rope_and_store(qk_norm: bool, pdl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel at Llama / Qwen3 attention shapes against the reference kernels run in turn
    (the norm's sum runs in another order: a last-bit difference is allowed there, none otherwise);
    with PDL, positions, cos/sin and slots are read before its wait (kernels/pdl.py)."""
    monkeypatch.setenv("TOKENSPEED_PDL", pdl)
    from tokenspeed.layers.rope_scaling import RopeConfig
    from tokenspeed.layers.rotary_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=1e6), head_dim=DIM, max_position_embeddings=131072, dtype=BF16,
                             device="cuda")
    gen = torch.Generator().manual_seed(7)
    tokens = 300
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(BF16).cuda()
    q = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    positions = torch.randint(0, 131072, (tokens,), generator=gen).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:tokens].cuda()
    slots[::7] = -1
    norms = {}
    if qk_norm:
        norms = {"q_norm_weight": (torch.rand(DIM, generator=gen) + 0.5).to(BF16).cuda(),
                 "k_norm_weight": (torch.rand(DIM, generator=gen) + 0.5).to(BF16).cuda(), "norm_eps": 1e-6}
    caches = [torch.zeros(64, 16, KV_HEADS, DIM, dtype=BF16, device="cuda") for _ in range(4)]
    args = (positions, rotary.cos_cache, rotary.sin_cache)
    want = rope_write_reference(q.clone(), k, v, *args, caches[2], caches[3], slots, **norms)
    got = rope_write_triton(q, k, v, *args, caches[0], caches[1], slots, **norms)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


def test_silu_and_mul_bf16() -> None:
    x = torch.randn(300, 2 * 14336, generator=torch.Generator().manual_seed(5)).to(BF16).cuda()
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x))


def test_sampler_distribution_matches_reference() -> None:
    vocab, draws = 64, 200_000
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 2).cuda()
    for temperature, top_k, top_p, min_p in [
        (1.0, 0, 1.0, 0.0),
        (0.7, 10, 1.0, 0.0),
        (1.2, 0, 0.85, 0.0),
        (1.0, 20, 0.9, 0.02),
    ]:
        ones = torch.ones(draws, device="cuda")
        tokens = sample_triton(
            logits.expand(draws, vocab),
            ones * temperature,
            torch.full((draws,), top_k, dtype=torch.int32, device="cuda"),
            ones * top_p,
            ones * min_p,
            torch.full((draws,), 1234, device="cuda"),
            torch.arange(draws, device="cuda"),
        )
        probs = filter_probs_reference(torch.softmax(logits / temperature, -1), top_k, top_p, min_p)
        probs = probs / probs.sum()
        freq = torch.bincount(tokens, minlength=vocab).float() / draws
        assert float(freq[probs == 0].sum()) == 0.0
        assert float((freq - probs).abs().max()) < 6e-3, (temperature, top_k, top_p, min_p)


def test_sampler_full_vocabulary_thresholds_greedy_and_keys() -> None:
    rows, vocab = 64, 151936
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    temperature = torch.rand(rows, generator=gen).cuda() + 0.3
    temperature[:8] = 0.0  # greedy rows
    top_k = torch.randint(0, 100, (rows,), generator=gen, dtype=torch.int32).cuda()
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.9).cuda()
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 0.05, 0.0).cuda()
    params = (temperature, top_k, top_p, min_p)
    thresholds = kept_threshold_bits(logits, *params)
    for row in range(8, rows):
        t = float(temperature[row])
        q = torch.exp2((logits[row] - logits[row].max()) * (LOG2E / t))
        kept = q.view(torch.int32) >= thresholds[row]
        ref = (
            filter_probs_reference(
                torch.softmax(logits[row] / t, -1), int(top_k[row]), float(top_p[row]), float(min_p[row])
            )
            > 0
        )
        assert int((kept ^ ref).sum()) <= 2, row  # rounding may move the boundary token
    seeds, indices = torch.arange(rows, device="cuda"), torch.full((rows,), 3, device="cuda")
    tokens = sample_triton(logits, *params, seeds, indices)
    assert torch.equal(tokens[:8], logits[:8].argmax(-1))
    assert torch.equal(tokens, sample_triton(logits, *params, seeds, indices))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("vocab", [128256, 151936, 32000])
def test_greedy_argmax_full_vocabulary(vocab: int, dtype: torch.dtype) -> None:
    """First maximum of each row (ties planted across and within chunks) for 1-256 rows, as torch.argmax."""
    from tokenspeed.kernels import arrival_counters
    from tokenspeed.kernels.sampling.argmax_triton import CHUNK, argmax_triton

    gen = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 64, 256):
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        logits[0, [CHUNK + 1, vocab - 1]] = 40.0
        if rows > 1:
            logits[1, [vocab - 2, vocab - 1]] = 40.0
        logits = logits.cuda()
        assert torch.equal(argmax_triton(logits), torch.argmax(logits.float(), dim=-1)), rows
    assert arrival_counters.all_at_rest()


def test_layers_select_triton_on_cuda_and_honour_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed.layers.mlp import GatedMLP
    from tokenspeed.layers.norm import RMSNorm
    from tokenspeed.layers.rope_scaling import RopeConfig
    from tokenspeed.layers.rotary_embedding import RotaryEmbedding

    assert RMSNorm(64, 1e-6, dtype=BF16, device="cuda")._kernel is rms_norm_triton
    assert GatedMLP(64, 128, dtype=BF16, device="cuda")._act is silu_and_mul_triton
    rotary = RotaryEmbedding(
        RopeConfig(), head_dim=DIM, max_position_embeddings=64, dtype=BF16, device="cuda"
    )
    assert rotary._kernel is apply_rope_triton
    from tokenspeed.layers.attention import GQAAttention

    def attention() -> GQAAttention:
        return GQAAttention(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=DIM, rotary=rotary, dtype=BF16,
                            device="cuda")

    assert attention().rope_write is rope_write_triton
    monkeypatch.setenv("TOKENSPEED_KERNEL_KVSTORE_ROPE_WRITE", "reference")
    assert attention().rope_write is None  # the separate kernels
    monkeypatch.delenv("TOKENSPEED_KERNEL_KVSTORE_ROPE_WRITE")
    monkeypatch.setenv("TOKENSPEED_KERNEL_NORM_RMS", "reference")
    assert RMSNorm(64, 1e-6, dtype=BF16, device="cuda")._kernel is rms_norm_reference


@pytest.mark.parametrize("placeholders, request_table", [(True, True), (False, False)])
@pytest.mark.parametrize("tokens, rows, width", [(1, 1, 1), (64, 64, 2048), (8192, 3, 600)])
def test_step_inputs_equals_the_reference(placeholders: bool, request_table: bool, tokens: int, rows: int,
                                          width: int) -> None:
    """A step's device inputs in one launch: decode at 64 rows of 32K tokens, a prefill chunk of 8K tokens."""
    staged = staged_case(tokens, rows, width, placeholders, request_table, device="cuda")
    assert_same_inputs(step_inputs_triton(staged), step_inputs_reference(staged))
