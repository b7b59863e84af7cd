"""The CPU decode forward with and without pre-packed GEMM weights, in one process, on real decode batches.

    python benchmarks/cpu_gemm_prepack_forward.py [--batches 1 2 4 8 16] [--context 256] [--rounds 15]
        [--small-rows 8 16 64] [--out FILE]

Why: `benchmarks/cpu_linear_gemm.py` times each GEMM alone in a loop, where MKL's `F.linear` has its
weight and packing buffers hot; inside the decode forward every GEMM follows other work, and the
choice of `cpu_linear.ROWS_MIN_BY_SIZE` / `SMALL_WEIGHT_ROWS` should come from there. This builds the
embedded model (`LLM`, one torch thread), runs B requests of `--context` random tokens to capture a
B-row decode batch per B, then times `CPUDecodeForward.run(batch, logits_rows=True)` + `logits` (the
runner's decode step minus sampling and host work) for several forwards built on the same model and
K/V pool (re-running a batch rewrites its K/V with the same values):

- `off`: `prepack=False` (`F.linear` everywhere, bit-equal to the layers);
- `default`: the shipped thresholds;
- `small_from_R`: the small weights (qkv, o_proj, down: under 2^18 elements) packed from R rows.

Variants are interleaved round by round; each round is the mean of `--calls` calls; best and median of
`--rounds` rounds, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "cpu_gemm_prepack_forward.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--small-rows", type=int, nargs="*", default=[8, 16, 64])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch

    from tokenspeed import LLM, SamplingParams
    from tokenspeed.executor import cpu_linear
    from tokenspeed.executor.cpu_decode import CPUDecodeForward

    torch.set_num_threads(1)
    llm = LLM(show_progress=False, cpu_threads=1, max_model_len=args.context + 128,
              max_num_seqs=max(args.batches), seed=0)
    executor: Any = llm.core.executor
    runner = executor.runner
    assert runner.cpu_decode is not None, "no CPU decode forward for this model"
    batches: dict[int, Any] = {}
    run = runner.cpu_decode.run

    def grab(batch: Any, **kwargs: Any) -> Any:
        if batch.attn.max_query_len == 1:
            batches[batch.num_tokens] = batch
        return run(batch, **kwargs)

    runner.cpu_decode.run = grab
    rng = random.Random(0)
    for b in args.batches:
        prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(args.context)]} for _ in range(b)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)

    forwards: dict[str, Any] = {"off": CPUDecodeForward(runner.model, runner.kv, prepack=False),
                                "default": CPUDecodeForward(runner.model, runner.kv, prepack=True)}
    shipped = cpu_linear.ROWS_MIN_BY_SIZE
    for rows in args.small_rows:
        cpu_linear.ROWS_MIN_BY_SIZE = (*shipped, (0, rows))
        forwards[f"small_from_{rows}"] = CPUDecodeForward(runner.model, runner.kv, prepack=True)
    cpu_linear.ROWS_MIN_BY_SIZE = shipped

    def step(fast: Any, batch: Any) -> Any:
        return fast.logits(fast.run(batch, logits_rows=True))

    results: dict[str, Any] = {}
    with torch.inference_mode():
        for b in args.batches:
            batch = batches.get(b)
            if batch is None:
                print(f"no {b}-row decode batch seen", file=sys.stderr)
                continue
            samples: dict[str, list[float]] = {name: [] for name in forwards}
            for _ in range(args.rounds):
                for name, fast in forwards.items():
                    step(fast, batch)
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        step(fast, batch)
                    samples[name].append((time.perf_counter() - t0) / args.calls * 1e3)
            results[f"b{b}"] = {name: {"best_ms": round(min(v), 3), "median_ms": round(statistics.median(v), 3)}
                                for name, v in samples.items()}
            print(f"B={b:2d} " + "  ".join(f"{name} {min(v):.3f}/{statistics.median(v):.3f}"
                                           for name, v in samples.items()), flush=True)
    llm.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    args.out.write_text(json.dumps({"command": command, "load_average": os.getloadavg(),
                                    "unit": "ms per run+logits, best/median of rounds", "results": results},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
