"""Where a CPU decode step's time goes: whole step, model forward, LM head, sampling, host.

    python benchmarks/cpu_decode_step.py [--batches 1 4 16] [--context 512] [--steps 48]
        [--rounds 3] [--tree NAME=PATH ...] [--variant NAME=JSON ...] [--out FILE]

Runs the embedded model (fp32, one torch thread: the engine's choice on 2 vCPUs)
through the public `LLM` API: per batch size B it submits B prompts of
`--context` random token ids (no shared prefix) with greedy sampling,
`ignore_eos` and `--steps` output tokens each, and records every engine step
(`EngineCore.step`) whose batch is B decode rows. Per such step it splits the
wall time into

- `forward_ms`: the decoder stack (`model(batch, kv)`, or the runner's CPU
  decode forward `runner.cpu_decode` where there is one),
- `logits_ms`: the LM head on the sampled rows,
- `sample_ms`: the sampler (`ModelRunner._sample`),
- `host_ms`: the rest: scheduler plan/advance, page tables, batch building,
  the output path (step minus the three above).

Medians over the decode steps of each round (and `step_p10_ms`, the lower decile of
the step time: the steps other processes did not disturb), best round kept. `tok_s` is
B * steps over the whole `generate` call (prefill included).

Then, at the model-runner level, it re-runs the last B-row decode batch it saw
(the last of the widest: the final steps of a chunked prefill's batch can be
narrower; `runner_rows` says how many rows it had; its K/V are still in the pool) in a loop: `runner_forward_ms` is the best of
`--repeat` calls of forward + LM head, and `aten_ops` counts the aten calls one
such call dispatches (torch.profiler): `total` counts nested calls too,
`top_level` only those called from Python, and `by_name` the most frequent top-level ones.

Side by side: each `--tree NAME=PATH` (a checkout of the repository, e.g.
`before=/work/main after=.`) and each `--variant NAME=JSON` (LLM keyword
arguments, e.g. `eager={"enforce_eager": true}`) is measured in its own
subprocess, interleaved round by round, so background load hits all alike.
Without --tree the current checkout runs. Results (with the command) go to
`--out` (default `benchmarks/results/cpu/cpu_decode_step.json`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_side_by_side  # noqa: E402  (the probe and driver shared with cpu_prefill_step.py)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_decode_step.json"


# ---- one measurement, in this process ----------------------------------------------------------


class StepProbe(cpu_side_by_side.StepProbe):
    """The shared step probe; also marks each step's decode rows (-1: not decode-only) and keeps the last
    decode batch."""

    def __init__(self, llm: Any) -> None:
        self.last_decode_batch: Any = None
        super().__init__(llm)

    def note_batch(self, batch: Any) -> None:
        attn = batch.attn
        rows = len(attn.seq_lens)
        decode = attn.max_query_len == 1 and batch.num_tokens == rows
        self.current["rows"] = rows if decode else -1
        # the last of the widest decode batches: at B=16 the final steps run only the last-admitted rows
        # (prefill is chunked), so the very last decode batch can be a few rows narrower than B
        if decode and (self.last_decode_batch is None or rows >= len(self.last_decode_batch.attn.seq_lens)):
            self.last_decode_batch = batch


def runner_forward(runner: Any, batch: Any) -> Any:
    """Forward + LM head of one batch, as the runner runs a decode step."""
    fast = getattr(runner, "cpu_decode", None)
    if fast is None:
        return runner.model.compute_logits(runner.model(batch, runner.kv).index_select(0, batch.logits_indices))
    logits = getattr(fast, "logits", runner.model.compute_logits)  # the pre-packed LM head where there is one
    return logits(fast.run(batch).index_select(0, batch.logits_indices))


def count_aten_ops(runner: Any, batch: Any) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        runner_forward(runner, batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner_forward(runner, batch)
    total = 0
    top: dict[str, int] = {}
    for evt in prof.events():
        if not evt.name.startswith("aten::"):
            continue
        total += 1
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            top[evt.name] = top.get(evt.name, 0) + 1
    by_name = dict(sorted(top.items(), key=lambda item: -item[1])[:12])
    return {"total": total, "top_level": sum(top.values()), "by_name": by_name}


def measure(args: argparse.Namespace, llm_kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    import random

    import torch

    from tokenspeed import SamplingParams

    t0 = time.perf_counter()
    llm = cpu_side_by_side.build_llm(llm_kwargs, args.context + args.steps + 64, max(args.batches))
    build_s = time.perf_counter() - t0
    probe = StepProbe(llm)
    rng = random.Random(seed)
    vocab = llm.core.executor.model_config.vocab_size
    out: dict[str, Any] = {"engine_build_s": round(build_s, 2)}
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    try:
        # warm-up: one short request per batch size (first-call costs, compiled graphs)
        for b in args.batches:
            prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(32)]} for _ in range(b)]
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for b in args.batches:
            probe.steps.clear()
            probe.last_decode_batch = None
            prompts = [
                {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.context)]} for _ in range(b)
            ]
            t0 = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            assert all(len(r.outputs[0].token_ids) == args.steps for r in results)
            decode = [s for s in probe.steps if s.get("rows") == b and "forward" in s]
            # the first and last decode steps overlap prefill resolution / draining: drop them
            decode = decode[1:-1] or decode
            med = {
                name: statistics.median(s.get(name, 0.0) for s in decode) * 1e3
                for name in ("step", "forward", "logits", "sample")
            }
            host = statistics.median(StepProbe.host_seconds(s) for s in decode) * 1e3
            steps_sorted = sorted(s["step"] for s in decode)
            row: dict[str, Any] = {
                "decode_steps": len(decode),
                "step_ms": round(med["step"], 3),
                # the lower decile: steps that ran undisturbed by other processes on a shared machine
                "step_p10_ms": round(steps_sorted[len(steps_sorted) // 10] * 1e3, 3),
                "forward_ms": round(med["forward"], 3),
                "logits_ms": round(med["logits"], 3),
                "sample_ms": round(med["sample"], 3),
                "host_ms": round(host, 3),
                "tok_s": round(b * args.steps / wall, 1),
                "tokens": [list(r.outputs[0].token_ids[:8]) for r in results[:2]],
            }
            batch = probe.last_decode_batch
            runner = probe.runner
            with torch.inference_mode():
                for _ in range(3):
                    runner_forward(runner, batch)
                times = []
                for _ in range(args.repeat):
                    t1 = time.perf_counter()
                    runner_forward(runner, batch)
                    times.append(time.perf_counter() - t1)
            row["runner_rows"] = len(batch.attn.seq_lens)
            row["runner_forward_ms"] = round(min(times) * 1e3, 3)
            row["runner_forward_median_ms"] = round(statistics.median(times) * 1e3, 3)
            row["aten_ops"] = count_aten_ops(runner, batch)
            out[f"b{b}"] = row
    finally:
        llm.shutdown()
    return out


# ---- the driver: subprocesses per (tree, variant), interleaved ------------------------------------


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size the round with the lowest step time; every round's step time beside it."""
    best: dict[str, Any] = {"engine_build_s": min(r["engine_build_s"] for r in rounds)}
    for key in rounds[0]:
        if not key.startswith("b"):
            continue
        chosen = min(rounds, key=lambda r: r[key]["step_ms"])[key]
        chosen = dict(chosen)
        chosen["runner_forward_ms"] = min(r[key]["runner_forward_ms"] for r in rounds)
        chosen["step_p10_ms"] = min(r[key]["step_p10_ms"] for r in rounds)
        chosen["step_ms_rounds"] = [r[key]["step_ms"] for r in rounds]
        best[key] = chosen
    return best


def round_summary(res: dict[str, Any]) -> str:
    """One round's line of progress."""
    summary = {k: v["step_ms"] for k, v in res.items() if k.startswith("b")}
    return f"step_ms {summary}"


def print_results(results: dict[str, Any]) -> None:
    """The best rounds' table."""
    print(f"\n{'config':<24} {'B':>3} {'step':>7} {'p10':>7} {'fwd':>7} {'lmhead':>7} {'sample':>7} {'host':>7} "
          f"{'runner':>7} {'tok/s':>7} {'ops':>5}")
    for name, res in results.items():
        for key, row in res.items():
            if not key.startswith("b"):
                continue
            print(f"{name:<24} {key[1:]:>3} {row['step_ms']:7.2f} {row['step_p10_ms']:7.2f} {row['forward_ms']:7.2f} {row['logits_ms']:7.2f} "
                  f"{row['sample_ms']:7.2f} {row['host_ms']:7.2f} {row['runner_forward_ms']:7.2f} "
                  f"{row['tok_s']:7.1f} {row['aten_ops']['top_level']:5d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=50, help="runner-level forward calls per batch size")
    cpu_side_by_side.add_driver_arguments(parser, DEFAULT_OUT)
    args = parser.parse_args()

    forwarded = ["--batches", *map(str, args.batches), "--context", str(args.context),
                 "--steps", str(args.steps), "--repeat", str(args.repeat)]

    cpu_side_by_side.run_side_by_side(__file__, args, forwarded, measure, best_of, round_summary, print_results)


if __name__ == "__main__":
    main()
