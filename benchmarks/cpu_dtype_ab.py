"""fp32 against bf16 on the CPU, through the public `LLM` API: is bf16 worth choosing on this CPU?

    python benchmarks/cpu_dtype_ab.py --out benchmarks/results/cpu/cpu_dtype_ab.json

The embedded model, one thread, prefix caching off. Per dtype: a 512-token prefill (best of 3), the
decode step at 4 rows ((time for 65 tokens - time for 1) / 64, best of 2) and the first greedy tokens
of one prompt, with the CPU's bf16 instructions (`avx512_bf16`, `amx_bf16`) beside them. `auto`
resolves to fp32 on the CPU (`config.resolve_dtype`); this is the measurement behind that choice.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_results import write_result  # noqa: E402


def cpu_bf16_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile"))


def measure(dtype: str) -> dict[str, Any]:
    from tokenspeed import LLM, SamplingParams

    llm = LLM(device="cpu", dtype=dtype, enable_prefix_caching=False, show_progress=False, seed=0, cpu_threads=1)
    vocab = llm.core.executor.model_config.vocab_size
    rng = random.Random(0)

    def run(prompts: int, length: int, tokens: int) -> tuple[float, Any]:
        batch = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(prompts)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, out

    run(1, 64, 4)  # warm-up: native kernels built and loaded
    prefill = min(run(1, 512, 1)[0] for _ in range(3))
    decode = min((run(4, 64, 65)[0] - run(4, 64, 1)[0]) / 64 for _ in range(2))
    tokens = list(run(1, 32, 16)[1][0].outputs[0].token_ids)
    llm.shutdown()
    return {"prefill_512_ms": round(prefill * 1e3, 1), "decode_step_4_rows_ms": round(decode * 1e3, 2),
            "greedy_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/cpu_dtype_ab.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {"cpu_bf16_flags": cpu_bf16_flags()}
    for dtype in ("float32", "bfloat16"):
        results[dtype] = measure(dtype)
        print(dtype, results[dtype], flush=True)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
