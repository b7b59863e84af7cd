"""The CPU's batched decode attention (`attention.decode=torch_batched`) against the REFERENCE.

Random paged caches with shuffled pages, rows of different lengths (some not a
multiple of the page size, one of length 0 = batch padding), GQA/MQA/MHA, page
sizes 1/4/16, sliding windows, low-precision inputs, the row-chunking path for
long contexts, and the engine's greedy tokens with the reference forced.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import prompts
from tests.paged_kernels import shuffled_page_table
from tokenspeed import LLM, SamplingParams
from tokenspeed.kernels import clear_kernel_overrides, select_kernel
from tokenspeed.kernels.attention import decode_torch_batched
from tokenspeed.kernels.attention.decode_torch_batched import decode_attention_torch_batched
from tokenspeed.kernels.attention.paged_reference import decode_attention_reference
from tokenspeed.layers.attention_backend import PagedAttentionBackend


def _case(
    lengths: list[int],
    heads: int,
    kv_heads: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    dim: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=3)
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


LENGTHS = [1, 7, 16, 33, 0, 20, 5]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 64])
def test_batched_decode_matches_reference(heads: int, kv_heads: int, page_size: int, window: int | None) -> None:
    q, k_cache, v_cache, table, lens = _case(LENGTHS, heads, kv_heads, page_size, seed=heads + page_size)
    args = (q, k_cache, v_cache, table, lens)
    out = decode_attention_torch_batched(*args, scale=0.3, sliding_window=window)
    expected = decode_attention_reference(*args, scale=0.3, sliding_window=window)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[LENGTHS.index(0)] == 0)  # a padding row gives zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
def test_batched_decode_low_precision(dtype: torch.dtype, window: int | None) -> None:
    q, k_cache, v_cache, table, lens = _case(LENGTHS, 8, 2, 4, dtype=dtype, seed=5)
    args = (q, k_cache, v_cache, table, lens)
    out = decode_attention_torch_batched(*args, scale=0.25, sliding_window=window)
    expected = decode_attention_reference(*args, scale=0.25, sliding_window=window)
    assert out.dtype == dtype
    # Both compute in fp32 and round once; at most one rounding step apart.
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_batched_decode_int64_inputs_wide_table_and_all_padding() -> None:
    q, k_cache, v_cache, table, lens = _case([9, 3], 4, 2, 4, seed=9)
    wide = torch.cat([table, torch.zeros(2, 5, dtype=table.dtype)], dim=1).long()  # engine tables are padded
    out = decode_attention_torch_batched(q, k_cache, v_cache, wide, lens.long(), scale=0.5)
    expected = decode_attention_reference(q, k_cache, v_cache, table, lens, scale=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    zeros = decode_attention_torch_batched(q, k_cache, v_cache, table, torch.zeros(2, dtype=torch.int32), scale=1.0)
    assert torch.all(zeros == 0)
    empty = decode_attention_torch_batched(q[:0], k_cache, v_cache, table[:0], lens[:0], scale=1.0)
    assert empty.shape == (0, 4, 16)


@pytest.mark.parametrize("window", [None, 10])
def test_batched_decode_chunks_rows_under_the_element_budget(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    lengths = [40, 3, 0, 25, 17, 1, 38, 9]
    q, k_cache, v_cache, table, lens = _case(lengths, 4, 2, 4, seed=13)
    args = (q, k_cache, v_cache, table, lens)
    expected = decode_attention_reference(*args, scale=0.3, sliding_window=window)
    # 2 kv heads x 16 dims = 32 elements a position: 3 rows of 40 positions per chunk, and 1 row per chunk.
    for budget in (3 * 40 * 32, 1):
        monkeypatch.setattr(decode_torch_batched, "ELEMENT_BUDGET", budget)
        out = decode_attention_torch_batched(*args, scale=0.3, sliding_window=window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_registry_picks_batched_decode_on_cpu_and_reference_stays_selectable() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert select_kernel("attention", "decode", platform="cpu", dtype=dtype).name == "torch_batched"
    backend = PagedAttentionBackend.select(platform="cpu", dtype=torch.float32, head_dim=64, sliding_window=True)
    assert backend.decode.name == "torch_batched" and backend.extend.name == "torch_sdpa"
    assert select_kernel("attention", "decode", platform="cuda", dtype=torch.bfloat16).name != "torch_batched"
    try:
        from tokenspeed.kernels import set_kernel_override

        set_kernel_override("attention", "decode", "reference")
        assert select_kernel("attention", "decode", platform="cpu", dtype=torch.float32).name == "reference"
    finally:
        clear_kernel_overrides()


@pytest.mark.parametrize("family", ["llama", "mistral"])  # GQA; MHA with a sliding window
def test_engine_greedy_tokens_same_with_reference_decode(checkpoints, family: str) -> None:
    batch = [{"prompt_token_ids": p} for p in prompts(6, seed=4, min_len=5, max_len=45)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate(**engine_args) -> list[list[int]]:
        llm = LLM(str(checkpoints[family]), skip_tokenizer_init=True, page_size=4, **engine_args)
        return [o.outputs[0].token_ids for o in llm.generate(batch, params)]

    try:
        fast = generate()
        reference = generate(kernel_overrides=("attention.decode=reference",))
    finally:
        clear_kernel_overrides()
    assert fast == reference
