"""Our models vs Hugging Face on tiny random checkpoints (CPU, fp32).

Each case saves a tiny HF model with `save_pretrained`, loads it with our
loader, runs prompts through the paged KV cache with pages scattered over the
pool, and compares logits at every position. The two-step case prefills a
prefix, then extends with the rest, which must read the first step's K/V back
from the pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.models import ModelConfig, build_model, load_weights

PAGE_SIZE = 4
TOLERANCE = 1e-4
PROMPT_LENGTHS = (1, 5, 13, 21)
COMMON = dict(num_hidden_layers=2, vocab_size=101, max_position_embeddings=64, rms_norm_eps=1e-5)


@dataclass(frozen=True)
class Case:
    config_cls: type
    model_cls: type
    kwargs: dict[str, Any]


CASES: dict[str, Case] = {
    "llama-tied-llama3": Case(
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-yarn-bias-headdim24": Case(
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=16
            ),
        ),
    ),
    "qwen2-bias-mqa": Case(
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=1),
    ),
    "qwen2-window-upper-layers": Case(
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
    ),
    "qwen3-qk-norm": Case(
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, head_dim=32),
    ),
    "mistral-window8-mqa": Case(
        MistralConfig,
        MistralForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=1,
            sliding_window=8,
        ),
    ),
}


def _randomise(model: PreTrainedModel, seed: int) -> None:
    """Replace HF's init (norms at 1, tiny weights) with values that exercise every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


@dataclass
class Pair:
    hf: PreTrainedModel
    ours: torch.nn.Module
    config: ModelConfig


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case = CASES[request.param]
    torch.manual_seed(0)
    hf_config = case.config_cls(**COMMON, **case.kwargs)
    hf_config._attn_implementation = "eager"
    hf = case.model_cls(hf_config).eval()
    _randomise(hf, seed=1)
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    config = ModelConfig.from_pretrained(folder)
    ours = build_model(config, dtype=torch.float32, device="cpu")
    load_weights(ours, folder, load_format="safetensors")
    return Pair(hf, ours, config)


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _scattered_pages(lengths: list[int], seed: int = 7) -> list[list[int]]:
    """Give each prompt its pages from a shuffled pool, so no row's pages are contiguous or ordered."""
    needed = [-(-n // PAGE_SIZE) for n in lengths]
    pool = list(range(sum(needed) + 5))
    random.Random(seed).shuffle(pool)
    pages, used = [], 0
    for n in needed:
        pages.append(pool[used : used + n])
        used += n
    return pages


def _kv(config: ModelConfig, num_pages: int) -> PagedKVStorage:
    return PagedKVStorage(
        num_layers=config.num_layers,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device="cpu",
    )


def _hf_logits(hf: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def _run_step(model: torch.nn.Module, kv: PagedKVStorage, rows: list[RowSpec]) -> list[torch.Tensor]:
    """One forward over `rows`; returns each row's logits for all of its new tokens."""
    total = sum(len(r.input_token_ids) for r in rows)
    batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=range(total))
    with torch.no_grad():
        hidden = model(batch, kv)
        logits = model.compute_logits(hidden[batch.logits_indices])
    assert hidden.shape == (total, model.config.hidden_size)
    assert logits.dtype == torch.float32
    starts = batch.attn.query_start
    return [logits[starts[i] : starts[i + 1]] for i in range(len(rows))]


def _assert_close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    diff = (ours - reference).abs().max().item()
    assert diff < TOLERANCE, f"{what}: max abs diff {diff:.3g}"


def test_full_prompt_logits_match_hf(pair: Pair) -> None:
    prompts = _prompts(pair.config.vocab_size)
    pages = _scattered_pages([len(p) for p in prompts])
    kv = _kv(pair.config, num_pages=max(max(p) for p in pages) + 1)
    rows = [RowSpec(prompt, 0, page_ids) for prompt, page_ids in zip(prompts, pages)]
    for prompt, ours in zip(prompts, _run_step(pair.ours, kv, rows)):
        reference = _hf_logits(pair.hf, prompt)
        _assert_close(ours[-1], reference[-1], f"last position of a {len(prompt)}-token prompt")
        _assert_close(ours, reference, f"all positions of a {len(prompt)}-token prompt")


def test_prefill_then_extend_reads_kv_from_pages(pair: Pair) -> None:
    prompts = _prompts(pair.config.vocab_size, seed=11)
    pages = _scattered_pages([len(p) for p in prompts], seed=13)
    kv = _kv(pair.config, num_pages=max(max(p) for p in pages) + 1)
    # Split points: a decode-like last token, mid-page and page-aligned prefixes.
    splits = [0, len(prompts[1]) - 1, 6, 12]
    first = [RowSpec(p[:s], 0, pg) for p, s, pg in zip(prompts, splits, pages) if s > 0]
    _run_step(pair.ours, kv, first)
    second = [RowSpec(p[s:], s, pg) for p, s, pg in zip(prompts, splits, pages)]
    for prompt, split, ours in zip(prompts, splits, _run_step(pair.ours, kv, second)):
        reference = _hf_logits(pair.hf, prompt)[split:]
        _assert_close(ours, reference, f"extend of a {len(prompt)}-token prompt after {split} cached tokens")


def test_config_flags_follow_architecture(pair: Pair) -> None:
    """The parsed config must describe what the HF model actually has."""
    hf_attn = pair.hf.model.layers[0].self_attn
    assert pair.config.qkv_bias == (hf_attn.q_proj.bias is not None)
    assert pair.config.o_proj_bias == (hf_attn.o_proj.bias is not None)
    assert pair.config.qk_norm == hasattr(hf_attn, "q_norm")
    assert pair.config.head_dim == hf_attn.head_dim
    hf_config = pair.hf.config
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    assert pair.config.sliding_windows == tuple(window if t == "sliding_attention" else None for t in types)
