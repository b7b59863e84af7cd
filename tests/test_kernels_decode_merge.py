"""The split-KV decode's last split to finish merges the splits itself (`attention/decode_triton.py`,
`kernels/arrival_counters.py`), on the CPU under Triton's interpreter: bit for bit what the separate merge
kernel writes (`TOKENSPEED_DECODE_LAST_SPLIT_MERGES=0`), and every counter back at zero after each launch."""

from __future__ import annotations

import pytest
import torch

from tests.paged_kernels import shuffled_page_table
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels import arrival_counters
from tokenspeed.kernels.attention import decode_triton
from tokenspeed.kernels.attention.decode_triton import decode_attention_triton, verify_attention_triton
from tokenspeed.kernels.attention.paged_reference import decode_attention_reference
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)

SWITCH = "TOKENSPEED_DECODE_LAST_SPLIT_MERGES"


def _case(heads: int, kv_heads: int, lengths: list[int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    dim, page_size = 32, 4
    table, num_pages = shuffled_page_table(lengths, page_size, gen, spare_pages=2)
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


@interpreted
@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_splits", "window"),
    [(8, 2, 3, None), (8, 1, 8, 7), (4, 4, 5, None)],  # GQA 4, MQA with a window, MHA
)
def test_last_split_merge_equals_the_merge_kernel(
    heads: int, kv_heads: int, num_splits: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows: a padding row (0 keys: zeros), one shorter than a split (most splits empty), long ones."""
    args = _case(heads, kv_heads, [45, 0, 2, 90], torch.float32, seed=heads + num_splits)
    kwargs = dict(scale=32**-0.5, sliding_window=window, num_splits=num_splits)
    merged_in_kernel = decode_attention_triton(*args, **kwargs)
    assert arrival_counters.all_at_rest() and arrival_counters._COUNTERS  # counters were used, and reset
    monkeypatch.setenv(SWITCH, "0")
    assert not decode_triton.last_split_merges()
    by_merge_kernel = decode_attention_triton(*args, **kwargs)
    torch.testing.assert_close(merged_in_kernel, by_merge_kernel, rtol=0, atol=0)
    expected = decode_attention_reference(*args, scale=32**-0.5, sliding_window=window)
    torch.testing.assert_close(merged_in_kernel, expected, rtol=2e-5, atol=2e-5)
    assert bool((merged_in_kernel[1] == 0).all())


@interpreted
def test_last_split_merge_with_an_fp8_cache_and_in_unfolded_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_cache, v_cache, table, seq_lens = _case(8, 2, [33, 61], torch.float16, seed=3)
    k_scale, v_scale = torch.tensor([0.5, 0.25]), torch.tensor([2.0, 2.0])  # per kv head
    k8 = (k_cache.float() / k_scale[None, None, :, None]).to(FP8_DTYPE)
    v8 = (v_cache.float() / v_scale[None, None, :, None]).to(FP8_DTYPE)
    fp8 = dict(scale=0.2, num_splits=4, k_scale=k_scale, v_scale=v_scale)
    q_len = 3
    qv = torch.randn(2 * q_len, 8, 32, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(SWITCH, switch)
        outputs.append((decode_attention_triton(q, k8, v8, table, seq_lens, **fp8),
                        verify_attention_triton(qv, k_cache, v_cache, table, seq_lens, q_len=q_len, scale=0.2,
                                                num_splits=3, fold=1)))  # fmt: skip
        assert arrival_counters.all_at_rest()
    for on, off in zip(*outputs, strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=0)
