"""Device time of the verification math (`spec/verify.py`) at serving shapes.

    python benchmarks/spec_verify.py [--rows 1 16 64 256] [--k 2 4 8] [--vocab 128256] [--out PATH]

For each (rows, k) it times, on logits `[rows, k+1, vocab]` (bf16 on a GPU,
fp32 on the CPU), the three ways a verify step decides what is emitted:
`verify_greedy` (argmax + acceptance), `verify_point_mass` with the platform's
`sampling.sample` kernel (Triton on a GPU: what host drafters' sampled rows
use), and `rejection_sample` for drafted distributions (`filtered_probs` of
target and draft logits included: what EAGLE/MTP rows at temperature > 0
use). Rows mix temperatures 0.7-1.3 with top-k / top-p / min-p. GPU times are
medians over CUDA-event-timed repetitions after warm-up (eager, not captured),
so they include launch gaps; the executor will capture verify batches in CUDA
graphs. On the CPU it is a smoke run (use a small --vocab).

Writes {"command", "device", "date", "metrics"} with metrics
`<fn>_us_rows<R>_k<K>` to --out (default: $OUT/spec_verify.json when $OUT is
set, else benchmarks/results/cpu/spec_verify.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenspeed.kernels import select_kernel
from tokenspeed.kernels.sampling.reference import sample_reference
from tokenspeed.spec.verify import filtered_probs, rejection_sample, verify_greedy, verify_point_mass


def timed_us(call: Callable[[], object], device: torch.device, reps: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        else:
            begin = time.perf_counter()
            call()
            times.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times)


def case(rows: int, k: int, vocab: int, device: torch.device, sample: Callable[..., torch.Tensor], reps: int
         ) -> dict[str, float]:
    gen = torch.Generator().manual_seed(rows * 100 + k)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = (torch.randn(rows, k + 1, vocab, generator=gen) * 3).to(device, dtype)
    draft_logits = (torch.randn(rows, k, vocab, generator=gen) * 3).to(device, dtype)
    cycle = torch.arange(rows) % 4
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.9])[cycle].to(device)
    top_k = torch.tensor([0, 50, 0, 20], dtype=torch.int32)[cycle].to(device)
    top_p = torch.tensor([1.0, 0.95, 0.9, 1.0])[cycle].to(device)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0])[cycle].to(device)
    seeds = torch.arange(rows, dtype=torch.int64, device=device) * 7 + 1
    indices = torch.zeros(rows, dtype=torch.int64, device=device)
    drafts = torch.argmax(logits[:, :k], dim=-1)  # mostly accepted: every path is exercised
    num_drafts = torch.full((rows,), k, dtype=torch.int64, device=device)

    def per_position(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[:, None].expand(rows, n).reshape(-1)

    def rejection() -> object:
        target = filtered_probs(logits.reshape(-1, vocab), *(per_position(t, k + 1) for t in
                                                           (temperature, top_k, top_p, min_p)))
        draft = filtered_probs(draft_logits.reshape(-1, vocab), *(per_position(t, k) for t in
                                                                (temperature, top_k, top_p, min_p)))
        return rejection_sample(target.reshape(rows, k + 1, vocab), drafts, num_drafts, seeds, indices,
                                draft.reshape(rows, k, vocab))

    calls: dict[str, Callable[[], object]] = {
        "verify_greedy": lambda: verify_greedy(logits, drafts, num_drafts),
        "verify_point_mass": lambda: verify_point_mass(logits, drafts, num_drafts, temperature, top_k, top_p,
                                                       min_p, seeds, indices, sample=sample),
        "rejection_sample": rejection,
    }
    return {f"{name}_us_rows{rows}_k{k}": round(timed_us(call, device, reps), 1) for name, call in calls.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=20)
    default_out = Path(os.environ["OUT"]) / "spec_verify.json" if os.environ.get("OUT") else \
        Path(__file__).parent / "results" / "cpu" / "spec_verify.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sample: Callable[..., torch.Tensor] = sample_reference
    if device.type == "cuda":
        sample = select_kernel("sampling", "sample", platform="cuda").impl
    metrics: dict[str, float] = {}
    with torch.inference_mode():
        for rows in args.rows:
            for k in args.k:
                found = case(rows, k, args.vocab, device, sample, args.reps)
                print(found, flush=True)
                metrics.update(found)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    body = {
        "command": " ".join(["python", "benchmarks/spec_verify.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": f"{name}, torch {torch.__version__}, vocab {args.vocab}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
