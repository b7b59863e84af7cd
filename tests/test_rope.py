"""RoPE: our inverse frequencies, cos/sin tables and rotation equal transformers' for every scaling type."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tokenspeed.errors import ModelNotSupported
from tokenspeed.kernels.rope.reference import apply_rope_reference
from tokenspeed.layers.rope_scaling import compute_inv_freq
from tokenspeed.layers.rotary_embedding import RotaryEmbedding
from tokenspeed.models.config import ModelConfig, rope_config_from_hf

HEAD_DIM = 64
MAX_POS = 4096

ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=512,
    ),
    "yarn": dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=1024),
    "yarn-mscale": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=256,
        mscale=1.0,
        mscale_all_dim=0.707,
        beta_fast=16.0,
        beta_slow=2.0,
    ),
    "yarn-attention-factor-untruncated": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=2.0,
        original_max_position_embeddings=2048,
        attention_factor=1.3,
        truncate=False,
    ),
}


def _hf_config(params: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(params),
    )


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_and_attention_factor_match_transformers(case: str) -> None:
    hf_config = _hf_config(ROPE_CASES[case])
    rope_type = ROPE_CASES[case]["rope_type"]
    if rope_type == "default":
        expected, expected_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf_config, device="cpu"
        )
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device="cpu")
    config = ModelConfig.from_dict(hf_config.to_dict())
    inv_freq, factor = compute_inv_freq(config.rope, config.head_dim, config.max_position_embeddings)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-9)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_cos_sin_and_rotation_match_transformers(case: str) -> None:
    hf_config = _hf_config(ROPE_CASES[case])
    hf_rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([0, 1, 7, 300, 1023, 4095])
    x = torch.zeros(1, positions.numel(), HEAD_DIM)
    hf_cos, hf_sin = hf_rotary(x, positions[None])
    config = ModelConfig.from_dict(hf_config.to_dict())
    ours = RotaryEmbedding(config.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    half = HEAD_DIM // 2
    torch.testing.assert_close(ours.cos_cache[positions], hf_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache[positions], hf_sin[0, :, :half], rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(positions.numel(), 4, HEAD_DIM, generator=gen)
    k = torch.randn(positions.numel(), 2, HEAD_DIM, generator=gen)
    q_ours, k_ours = ours(positions, q, k)
    # HF layout: [batch, heads, seq, dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_both_config_dialects_parse_to_the_same_rope() -> None:
    checkpoint_style = {
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    v5_style = {
        "max_position_embeddings": 131072,
        "rope_parameters": {**checkpoint_style["rope_scaling"], "rope_theta": 500000.0},
    }
    old_type_key = {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_config_from_hf(checkpoint_style) == rope_config_from_hf(v5_style)
    assert rope_config_from_hf(old_type_key).rope_type == "linear"
    assert rope_config_from_hf({}).theta == 10000.0


def test_dynamic_rope_is_refused() -> None:
    with pytest.raises(ModelNotSupported, match="dynamic"):
        rope_config_from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_partial_rotary_leaves_the_tail_untouched() -> None:
    config = rope_config_from_hf({"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    rotary = RotaryEmbedding(config, head_dim=16, max_position_embeddings=32)
    assert rotary.rotary_dim == 8
    q = torch.randn(3, 2, 16)
    k = torch.randn(3, 1, 16)
    positions = torch.tensor([0, 5, 9])
    q_out, k_out = apply_rope_reference(q, k, positions, rotary.cos_cache, rotary.sin_cache)
    torch.testing.assert_close(q_out[..., 8:], q[..., 8:], rtol=0, atol=0)
    torch.testing.assert_close(k_out[0], k[0], rtol=0, atol=0)  # position 0 rotates by nothing
    assert not torch.allclose(q_out[1, :, :8], q[1, :, :8])
