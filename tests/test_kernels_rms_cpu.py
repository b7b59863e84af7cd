"""The CPU's fp32 RMSNorm (`norm.rms=torch_fp32`) equals the REFERENCE bit for bit; the engine's greedy
tokens are the same with every CPU fast path (decode, extend, norm) and with all of them switched off."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import prompts
from tokenspeed import LLM, SamplingParams
from tokenspeed.kernels import select_kernel
from tokenspeed.kernels.norm.rms_cpu import rms_norm_torch_fp32
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference


@pytest.mark.parametrize("shape", [(1, 256), (7, 64), (3, 8, 32), (0, 16)])
def test_fp32_rms_equals_reference_bitwise(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, residual = (torch.randn(*shape, generator=gen) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen)
    assert torch.equal(rms_norm_torch_fp32(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    normed, summed = rms_norm_torch_fp32(x, weight, 1e-5, residual)
    expected_normed, expected_summed = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(normed, expected_normed) and torch.equal(summed, expected_summed)


def test_registry_picks_fp32_rms_on_cpu_fp32_only() -> None:
    assert select_kernel("norm", "rms", platform="cpu", dtype=torch.float32).name == "torch_fp32"
    assert select_kernel("norm", "rms", platform="cpu", dtype=torch.bfloat16).name == "reference"


def test_engine_greedy_tokens_same_with_every_cpu_fast_path_off(checkpoints) -> None:
    batch = [{"prompt_token_ids": [9, 8, 7, 6, 5, 4] + p} for p in prompts(6, seed=3, min_len=4, max_len=36)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def generate(*overrides: str) -> list[list[int]]:
        llm = LLM(str(checkpoints["qwen3"]), skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=48,
                  kernel_overrides=overrides, show_progress=False)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        finally:
            llm.shutdown()

    off = ("attention.decode=reference", "attention.extend=reference", "norm.rms=reference")
    assert generate() == generate(*off)
