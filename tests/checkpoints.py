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
