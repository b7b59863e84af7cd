"""One workload run by an engine on one rank and on two (CPU, gloo, fp32), and the comparison of the two.

`run_workloads` drives two workloads through an engine built by `engine`:

- synchronous steps with log-probabilities of every prompt and generated
  position (`assert_same`: greedy tokens identical, log-probabilities within
  1e-5);
- an overlapped run built to hit the scheduler's paths: prompts that share
  pages with the first run (prefix-cache hits), a per-step token budget below
  the prompt lengths (chunked prefill) and a KV pool too small for the batch
  (preemption, counted): greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.checkpoints import prompts
from tokenspeed import LLM, SamplingParams

LOGPROB_TOLERANCE = 1e-5


def engine(folder: Path, tp: int, ep: bool, dp_attention: bool = False, **options: Any) -> LLM:
    """A small engine on `tp` ranks (experts over EP when `ep`); `options`: further engine options."""
    return LLM(
        str(folder),
        skip_tokenizer_init=True,
        show_progress=False,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        page_size=16,
        num_kv_pages=14,  # 8 pages for one max-length request; the overlapped batch needs more: preemption
        max_num_batched_tokens=40,  # below the longest prompts: chunked prefill
        tensor_parallel_size=tp,
        enable_expert_parallel=ep and tp > 1,
        enable_dp_attention=dp_attention and tp > 1,
        **options,
    )


def run_workloads(llm: LLM) -> dict[str, object]:
    first = prompts(3, seed=5, min_len=20, max_len=40)
    exact = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    sync = llm.generate([{"prompt_token_ids": p} for p in first], exact, use_tqdm=False)
    # prefixes of the first prompts (cache hits) and fresh prompts, more than the pool holds at once
    batch = [p + [7, 8, 9] for p in first] + prompts(5, seed=9, min_len=30, max_len=60)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    overlapped = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
    return {
        "sync": sync,
        "tokens": [o.outputs[0].token_ids for o in overlapped],
        "cached": sum(o.num_cached_tokens for o in overlapped),
        "preemptions": llm.core.scheduler.num_preemptions,
    }


def positions(output) -> list[dict[int, float]]:  # type: ignore[no-untyped-def]
    """{token: logprob} of every prompt and generated position of one output."""
    found = [p for p in (output.prompt_logprobs or []) if p is not None] + output.outputs[0].logprobs
    return [{token: lp.logprob for token, lp in position.items()} for position in found]


def assert_same(family: str, one: dict[str, object], two: dict[str, object]) -> None:
    for a, b in zip(one["sync"], two["sync"], strict=True):  # type: ignore[call-overload]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, (pa, pb) in enumerate(zip(positions(a), positions(b), strict=True)):
            assert pa.keys() == pb.keys(), f"{family}: top tokens differ at position {step}"
            for token, logprob in pa.items():
                assert abs(logprob - pb[token]) < LOGPROB_TOLERANCE, (family, step, token, logprob, pb[token])
    assert one["tokens"] == two["tokens"], family
    assert two["cached"] > 0, "the run must hit the prefix cache"
    assert two["preemptions"] > 0, "the run must preempt a request"
