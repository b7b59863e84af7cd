"""Shared pieces of the speculative-decoding engine tests: tiny checkpoints, agent-like prompts, runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.checkpoints import VOCAB, make_checkpoint, make_deepseek_checkpoint
from tokenspeed import LLM, SamplingParams

FAMILIES = ("llama", "qwen3_moe", "deepseek_v3")  # dense GQA, MoE, MLA + MoE
HOST_METHODS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
}


def make_family(family: str, folder: Path, **overrides: Any) -> Path:
    if family.startswith("deepseek"):
        return make_deepseek_checkpoint(family, folder, **overrides)
    return make_checkpoint(family, folder, **overrides)


def agent_prompts(count: int, seed: int = 0, shared: int = 24) -> list[list[int]]:
    """Prompts that repeat themselves (a file, then the request to reproduce it) behind a shared prefix,
    so drafts are both accepted and rejected, and later prompts hit the prefix cache."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared,), generator=generator).tolist()
    prompts = []
    for i in range(count):
        body = torch.randint(3, VOCAB, (8 + 5 * i,), generator=generator).tolist()
        prompts.append(prefix + body + body[: 4 + i] + body)
    return prompts


def run(folder: Path | str, spec: dict[str, Any] | str | None, prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams], *, verify_query_len: int = 1, **engine: Any
        ) -> tuple[list[Any], LLM]:
    """Outputs (one RequestOutput per prompt) of a fresh engine; the engine, for its stats.

    `verify_query_len` > 1 lays verify steps out as a GPU does for its CUDA graphs (every row padded
    to that many tokens, filler first), which the CPU does not do by itself."""
    llm = LLM(str(folder), speculative_config=spec, show_progress=False, skip_tokenizer_init=True, **engine)
    llm.core.executor.runner.verify_query_len = verify_query_len  # type: ignore[attr-defined]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outputs, llm


def token_ids(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]
