"""The CPU's SDPA extend attention (`attention.extend=torch_sdpa`) against the REFERENCE.

Mixed steps (prompts from position 0, chunks after a cached prefix, one-token
decode rows, a padding row), GQA/MQA/MHA, page sizes 1/4/16, sliding windows,
low precision, fp8 caches, and the engine's greedy tokens with the reference forced.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import prompts
from tests.paged_kernels import shuffled_page_table
from tokenspeed import LLM, SamplingParams
from tokenspeed.kernels import select_kernel
from tokenspeed.kernels.attention.extend_torch_sdpa import extend_attention_torch_sdpa
from tokenspeed.kernels.attention.paged_reference import extend_attention_reference
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE

# (kv length after the step, new tokens): a whole prompt, a chunk after a prefix, decodes, padding.
ROWS = [(21, 21), (30, 9), (7, 1), (0, 0), (16, 16), (40, 1), (5, 2)]
# Rows long enough to attend in causal query blocks (`causal_blocks`), and one past their limit.
LONG_ROWS = [(200, 200), (230, 130), (3, 1), (1100, 90), (129, 65)]


def _case(
    heads: int, kv_heads: int, page_size: int, dtype: torch.dtype = torch.float32, seed: int = 0, dim: int = 16,
    rows: list[tuple[int, int]] = ROWS,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [n for n, _ in rows]
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=2)
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor([q for _, q in rows]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, starts, torch.tensor(lengths, dtype=torch.int32), table


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_sdpa_extend_matches_reference(heads: int, kv_heads: int, page_size: int, window: int | None) -> None:
    args = _case(heads, kv_heads, page_size, seed=heads * 7 + page_size)
    out = extend_attention_torch_sdpa(*args, scale=0.3, sliding_window=window)
    expected = extend_attention_reference(*args, scale=0.3, sliding_window=window)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 100])
def test_sdpa_extend_long_rows_match_reference(window: int | None) -> None:
    """Causal query blocks (rows of 65..1024 positions, with and without a cached prefix) and a longer row."""
    args = _case(8, 2, 16, seed=3, rows=LONG_ROWS)
    out = extend_attention_torch_sdpa(*args, scale=0.3, sliding_window=window)
    expected = extend_attention_reference(*args, scale=0.3, sliding_window=window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_extend_low_precision(dtype: torch.dtype) -> None:
    args = _case(8, 2, 4, dtype=dtype, seed=3)
    out = extend_attention_torch_sdpa(*args, scale=0.25, sliding_window=6)
    expected = extend_attention_reference(*args, scale=0.25, sliding_window=6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_sdpa_extend_fp8_cache_with_scales() -> None:
    q, k_cache, v_cache, starts, lens, table = _case(8, 2, 4, seed=11)
    k8, v8 = (c.clamp(-4, 4).to(FP8_DTYPE) for c in (k_cache, v_cache))
    scales = {"k_scale": torch.tensor([0.5, 2.0]), "v_scale": torch.tensor([1.5, 0.25])}
    args = (q, k8, v8, starts, lens, table)
    out = extend_attention_torch_sdpa(*args, scale=0.3, **scales)
    torch.testing.assert_close(out, extend_attention_reference(*args, scale=0.3, **scales), rtol=1e-5, atol=1e-5)


def test_sdpa_extend_rejects_more_new_tokens_than_positions() -> None:
    q, k_cache, v_cache, _, _, table = _case(4, 2, 4)
    with pytest.raises(ValueError, match="new tokens"):
        extend_attention_torch_sdpa(
            q[:5], k_cache, v_cache, torch.tensor([0, 5]), torch.tensor([3]), table[:1], scale=1.0
        )
    with pytest.raises(ValueError, match="group evenly"):
        extend_attention_torch_sdpa(q[:, :3], k_cache, v_cache, torch.tensor([0, 5]), torch.tensor([9]), table[:1],
                                    scale=1.0)


def test_registry_picks_sdpa_extend_on_cpu_only() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert select_kernel("attention", "extend", platform="cpu", dtype=dtype).name == "torch_sdpa"
    assert select_kernel("attention", "extend", platform="cuda", dtype=torch.bfloat16).name != "torch_sdpa"


@pytest.mark.parametrize("family", ["llama", "mistral"])  # GQA; MHA with a sliding window
def test_engine_greedy_tokens_same_with_reference_extend(checkpoints, family: str) -> None:
    # Shared first tokens make later prompts extend after a cached prefix; chunking splits long prompts.
    batch = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12] + p} for p in prompts(5, seed=7, min_len=5, max_len=40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(*overrides: str) -> list[list[int]]:
        llm = LLM(str(checkpoints[family]), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=32,
                  kernel_overrides=overrides, show_progress=False)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        finally:
            llm.shutdown()

    assert generate() == generate("attention.extend=reference")
