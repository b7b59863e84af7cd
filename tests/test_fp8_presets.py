"""FP8 presets: what they resolve to, that they fit one H200, and dummy FP8 weights at their layouts (CPU).

The presets themselves (30-63 GB of FP8 weights) only run on the GPU
(`benchmarks/fp8_e2e.py`); here the same configs shrunk in width load dummy
FP8 weights (random values quantised with their own block scales) and decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.executor.memory_check import weight_bytes
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE
from tokenspeed.models import ModelConfig
from tokenspeed.models.presets import preset_dict
from tokenspeed.models.quant_config import resolve_quantization

H200_BYTES = 141 * 10**9
FP8_PRESETS = ("qwen3-30b-a3b-fp8", "deepseek-v3-fp8-8l", "qwen3-8b-fp8")


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_presets_are_block_fp8_and_fit_one_h200(name: str) -> None:
    raw = preset_dict(name)
    assert "tokenspeed_description" in raw
    fp8 = resolve_quantization(raw, None)
    assert fp8 is not None and fp8.serialized and fp8.block_size == (128, 128)
    config = ModelConfig.from_dict(raw)
    fp8_bytes = weight_bytes(config, torch.bfloat16, fp8=fp8)
    assert fp8_bytes < 0.6 * weight_bytes(config, torch.bfloat16)  # projections at one byte
    assert fp8_bytes < 0.5 * H200_BYTES  # room for the KV pool


def test_online_fp8_llama_preset_counts_its_bf16_load() -> None:
    config = ModelConfig.from_dict(preset_dict("llama-3.1-8b"))
    online = resolve_quantization(preset_dict("llama-3.1-8b"), "fp8")
    assert online is not None and not online.serialized and online.block_size is None
    # online quantisation loads the bf16 weights first: that is the peak the memory check must see
    assert weight_bytes(config, torch.bfloat16, fp8=online) == weight_bytes(config, torch.bfloat16)


_NARROW: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b-fp8": dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
    "deepseek-v3-fp8-8l": dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, n_routed_experts=8,
                               n_group=2, topk_group=1, num_experts_per_tok=2, num_hidden_layers=2,
                               first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                               q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                               v_head_dim=32, vocab_size=512, max_position_embeddings=512),
    "qwen3-8b-fp8": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
}


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_dummy_fp8_weights_load_and_decode(name: str, tmp_path: Path) -> None:
    raw = {k: v for k, v in preset_dict(name).items() if k != "tokenspeed_description"}
    (tmp_path / "config.json").write_text(json.dumps({**raw, **_NARROW[name]}))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, show_progress=False)
    model = llm.core.executor.model  # type: ignore[attr-defined]
    params = dict(model.named_parameters())
    fp8 = [n for n, p in params.items() if p.dtype == FP8_DTYPE]
    assert any("experts.w13" in n or "mlp.gate_up_proj" in n for n in fp8) and any("o_proj" in n for n in fp8)
    assert "lm_head.weight" not in fp8  # modules_to_not_convert
    for weight in fp8:
        scales = params[weight + "_scale_inv"]
        assert bool((scales > 0).all()), f"{weight}: dummy scales must be positive"
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
