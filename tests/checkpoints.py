"""Tiny random-weight Hugging Face checkpoints for parity tests (no downloads).

Each family is built with its `transformers` config class, initialised from a
fixed seed and saved with `save_pretrained` (safetensors), so our loader reads
exactly what it would read from a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 384

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    initializer_range=0.1,  # peaked logits: greedy argmax far from ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES: dict[str, dict[str, Any]] = {
    # Llama 3.1-style: tied embeddings, llama3 rope scaling, GQA 4:2, head_dim 16.
    "llama": dict(
        config="LlamaConfig",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Qwen2: qkv bias, MQA (one KV head), head_dim 8.
    "qwen2": dict(config="Qwen2Config", num_attention_heads=8, num_key_value_heads=1, rope_theta=1e6),
    # Qwen3: q/k RMSNorm, explicit head_dim 32 (larger than hidden/heads), GQA 4:1.
    "qwen3": dict(config="Qwen3Config", num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    # Mistral: no GQA sharing (MHA), sliding window small enough to matter.
    "mistral": dict(config="MistralConfig", num_attention_heads=4, num_key_value_heads=4, sliding_window=24),
    # Qwen3-MoE: 8 experts, top-2, renormalised; layer 1 of 3 is dense (`mlp_only_layers`).
    "qwen3_moe": dict(
        config="Qwen3MoeConfig",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Mixtral: 8 experts of intermediate_size 48, top-2, no sliding window (null in Mixtral configs).
    "mixtral": dict(
        config="MixtralConfig",
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
}


def make_checkpoint(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    spec = {**_COMMON, **FAMILIES[family], **overrides}
    config_cls = getattr(transformers, spec.pop("config"))
    config = config_cls(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def load_hf(folder: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return model.float().eval()


def prompts(count: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    """Token-id prompts of different lengths (ids 3.. avoid pad/bos/eos)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = min_len + (i * 7 + seed) % (max_len - min_len + 1)
        out.append(torch.randint(3, VOCAB, (length,), generator=generator).tolist())
    return out


# DeepSeek (MLA + MoE): layer 0 dense, layer 1 MoE; 8 experts in 4 groups, 2 groups kept, top-3.
_DEEPSEEK_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,  # unused by MLA, but transformers' default (128) breaks its eager path
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

DEEPSEEK_FAMILIES: dict[str, dict[str, Any]] = {
    # V3 with q low-rank (DeepSeek-V3 / Kimi-K2 shape), noaux_tc sigmoid routing, 1 shared expert.
    "deepseek_v3": dict(
        config="DeepseekV3Config", q_lora_rank=24, n_shared_experts=1, num_nextn_predict_layers=0
    ),
    # V3 without q low-rank (Moonlight shape), YaRN with mscale != mscale_all_dim (scale and cos/sin).
    "deepseek_v3_yarn": dict(
        config="DeepseekV3Config",
        q_lora_rank=None,
        n_shared_experts=2,
        routed_scaling_factor=2.446,
        num_nextn_predict_layers=0,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
            mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0,
        ),
    ),
    # V2 group-limited greedy softmax routing, complex (interleaved) rope, 2 shared experts.
    "deepseek_v2_group": dict(
        config="DeepseekV2Config", q_lora_rank=24, n_shared_experts=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
    ),
    # V2-Lite shape: no q low-rank, plain greedy routing.
    "deepseek_v2_greedy": dict(config="DeepseekV2Config", q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
}


def make_deepseek_checkpoint(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny DeepSeek checkpoint whose router is not degenerate.

    HF initialises the V3 correction bias to zeros, which would leave the bias
    path untested; it gets random values large enough to change choices.
    """
    import transformers

    spec = {**_DEEPSEEK_COMMON, **DEEPSEEK_FAMILIES[family], **overrides}
    config = getattr(transformers, spec.pop("config"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
        for name, param in model.named_parameters():
            if "norm" in name:  # norms at exactly 1 would hide a missing norm
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
