"""Helpers of the GPU generation tests against `transformers` (`test_gpu_generation.py`, `test_deepseek_gpu.py`).

Findings are reported, never hidden: `report` prints each entry and, with
`TOKENSPEED_GPU_REPORT=path`, appends it to that file as one JSON line.
"""

from __future__ import annotations

import gc
import json
import os

import torch

from tokenspeed import SamplingParams


def report(entry: dict) -> None:
    """Print `entry` as JSON, and append it to `TOKENSPEED_GPU_REPORT` when that is set."""
    print(json.dumps(entry))
    path = os.environ.get("TOKENSPEED_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token sequences differ (None: they agree where both run)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def free_cuda() -> None:
    """Release a dropped engine's or model's GPU memory before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """fp32 log-probabilities `[len(tokens), vocab]` of an HF model at each position of `tokens` after `prompt`."""
    full = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        return torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1].float(), dim=-1)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF's own free-running greedy continuation of `prompt`, exactly `new_tokens` long."""
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt], device="cuda"),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()


def greedy_with_logprobs(
    llm, batch: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Our greedy tokens for each prompt of `batch`, and our log-probability of each chosen token."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
    ]
    return tokens, logprobs


def hf_references(folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The checkpoint in HF twice on the GPU: fp32 compute on the bf16-rounded weights, and bf16."""
    import transformers

    hf32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    hf32 = hf32.to(torch.bfloat16).float()  # fp32 compute on exactly the bf16 weights the engine runs
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    return hf32, hf16
