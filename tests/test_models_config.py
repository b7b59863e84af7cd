"""ModelConfig normalisation: presets, both rope dialects, per-architecture flags and sliding windows."""

from __future__ import annotations

from typing import Any

import pytest

from tokenspeed.errors import ModelNotSupported
from tokenspeed.models import ModelConfig, list_presets, load_preset

BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=100,
)


def _config(architecture: str, **extra: Any) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [architecture], **BASE, **extra})


def test_llama_preset() -> None:
    c = load_preset("llama-3.1-8b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        4096,
        14336,
        32,
        32,
        8,
    )
    assert (c.head_dim, c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (
        128,
        128256,
        131072,
        1e-5,
    )
    assert c.rope.rope_type == "llama3" and c.rope.theta == 500000.0 and c.rope.factor == 8.0
    assert (c.rope.low_freq_factor, c.rope.high_freq_factor, c.rope.original_max_position_embeddings) == (
        1.0,
        4.0,
        8192,
    )
    assert not c.tie_word_embeddings and not c.qkv_bias and not c.qk_norm
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert c.dtype == "bfloat16" and c.sliding_windows == (None,) * 32


def test_qwen3_preset() -> None:
    c = load_preset("Qwen3-8B.json")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        4096,
        12288,
        36,
        32,
        8,
        128,
    )
    assert (c.vocab_size, c.rope.theta, c.max_position_embeddings, c.rms_norm_eps) == (
        151936,
        1e6,
        40960,
        1e-6,
    )
    assert c.rope.rope_type == "default" and c.qk_norm and not c.qkv_bias and not c.tie_word_embeddings
    assert c.sliding_windows == (None,) * 36  # use_sliding_window is false
    assert set(list_presets()) >= {"llama-3.1-8b", "qwen3-8b"}
    with pytest.raises(ValueError, match="available: .*llama-3.1-8b"):
        load_preset("gpt-5")


def test_head_dim_defaults() -> None:
    assert _config("LlamaForCausalLM").head_dim == 8
    assert _config("LlamaForCausalLM", head_dim=16).head_dim == 16
    assert _config("Qwen3ForCausalLM").head_dim == 128  # Qwen3Config's own default


def test_bias_flags_per_architecture() -> None:
    qwen2 = _config("Qwen2ForCausalLM")
    assert qwen2.qkv_bias and not qwen2.o_proj_bias
    llama = _config("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    assert llama.qkv_bias and llama.o_proj_bias and llama.mlp_bias
    assert not _config("MistralForCausalLM", mlp_bias=True).mlp_bias


def test_sliding_windows() -> None:
    assert _config("MistralForCausalLM", sliding_window=4096).sliding_windows == (4096,) * 4
    assert _config("MistralForCausalLM", sliding_window=None).sliding_windows == (None,) * 4
    # Qwen: only with use_sliding_window, and only from max_window_layers up, unless layer_types says otherwise.
    assert _config("Qwen2ForCausalLM", sliding_window=32).sliding_windows == (None,) * 4
    qwen2 = _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert qwen2.sliding_windows == (None, None, 32, 32)
    types = ["sliding_attention", "full_attention"] * 2
    qwen3 = _config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=16, layer_types=types)
    assert qwen3.sliding_windows == (16, None, 16, None)
    assert _config("LlamaForCausalLM", sliding_window=8).sliding_windows == (None,) * 4


def test_misc_fields_and_fallbacks() -> None:
    c = ModelConfig.from_dict({"model_type": "qwen2", **BASE, "dtype": "float16", "eos_token_id": 7})
    assert c.architecture == "Qwen2ForCausalLM" and c.dtype == "float16" and c.eos_token_ids == (7,)
    assert _config("LlamaForCausalLM", num_key_value_heads=None).num_kv_heads == 8
    with pytest.raises(ModelNotSupported, match="hidden_act"):
        _config("LlamaForCausalLM", hidden_act="gelu")
    with pytest.raises(ModelNotSupported, match="lacks 'vocab_size'"):
        ModelConfig.from_dict(
            {"architectures": ["LlamaForCausalLM"], **{k: v for k, v in BASE.items() if k != "vocab_size"}}
        )
