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
(its K/V are still in the pool) in a loop: `runner_forward_ms` is the best of
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
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_decode_step.json"


# ---- one measurement, in this process ----------------------------------------------------------


class StepProbe:
    """Wraps the engine's step, the model's forward and LM head and the runner's sampler with timers."""

    def __init__(self, llm: Any) -> None:
        core = llm.core
        runner = core.executor.runner
        self.runner = runner
        self.model = runner.model
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.last_decode_batch: Any = None

        def timed(name: str, fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        forward = self.model.forward

        def model_forward(batch: Any, kv: Any) -> Any:
            self._note_batch(batch)
            return forward(batch, kv)

        self.model.forward = timed("forward", model_forward)
        self.model.compute_logits = timed("logits", self.model.compute_logits)
        runner._sample = timed("sample", runner._sample)
        fast = getattr(runner, "cpu_decode", None)  # the CPU decode forward, where present
        if fast is not None:
            run = fast.run

            def fast_run(batch: Any, **kwargs: Any) -> Any:
                self._note_batch(batch)
                return run(batch, **kwargs)

            fast.run = timed("forward", fast_run)
        step = core.step

        def core_step() -> Any:
            self.current = {}
            t0 = time.perf_counter()
            out = step()
            self.current["step"] = time.perf_counter() - t0
            self.steps.append(self.current)
            return out

        core.step = core_step

    def _note_batch(self, batch: Any) -> None:
        attn = batch.attn
        rows = len(attn.seq_lens)
        decode = attn.max_query_len == 1 and batch.num_tokens == rows
        self.current["rows"] = rows if decode else -1
        if decode:
            self.last_decode_batch = batch


def runner_forward(runner: Any, batch: Any) -> Any:
    """Forward + LM head of one batch, as the runner runs a decode step."""
    fast = getattr(runner, "cpu_decode", None)
    hidden = runner.model(batch, runner.kv) if fast is None else fast.run(batch)
    return runner.model.compute_logits(hidden.index_select(0, batch.logits_indices))


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

    from tokenspeed import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        max_model_len=args.context + args.steps + 64,
        max_num_seqs=max(args.batches),
        cpu_threads=1,
        show_progress=False,
        seed=0,
    )
    kwargs.update(llm_kwargs)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
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
            host = statistics.median(
                (s["step"] - s.get("forward", 0.0) - s.get("logits", 0.0) - s.get("sample", 0.0)) for s in decode
            ) * 1e3
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=50, help="runner-level forward calls per batch size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout to measure")
    parser.add_argument("--variant", action="append", default=[], help="NAME=JSON of LLM keyword arguments")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON LLM kwargs: measure once, print JSON
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:
        print("RESULT " + json.dumps(measure(args, json.loads(args.child), args.seed)), flush=True)
        return

    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("current", str(REPO))]
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [("default", "{}")]
    configs = [(f"{t}" if len(variants) == 1 else f"{t}/{v}" if len(trees) > 1 else v, path, kw)
               for t, path in trees for v, kw in variants]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    forwarded = ["--batches", *map(str, args.batches), "--context", str(args.context),
                 "--steps", str(args.steps), "--repeat", str(args.repeat)]
    for r in range(args.rounds):
        for name, path, kw in configs:
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()), OMP_NUM_THREADS="1")
            proc = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child", kw, "--seed", str(r)],
                env=env, capture_output=True, text=True, check=False,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise SystemExit(f"{name} failed in round {r}")
            rounds[name].append(json.loads(line.removeprefix("RESULT ")))
            summary = {k: v["step_ms"] for k, v in rounds[name][-1].items() if k.startswith("b")}
            print(f"round {r} {name}: step_ms {summary}", flush=True)
    results = {name: best_of(rs) for name, rs in rounds.items()}
    document = {
        "command": "python " + " ".join([str(Path(__file__).relative_to(REPO)), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "configs": {name: {"tree": path, "llm_kwargs": json.loads(kw)} for name, path, kw in configs},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\n{'config':<24} {'B':>3} {'step':>7} {'p10':>7} {'fwd':>7} {'lmhead':>7} {'sample':>7} {'host':>7} "
          f"{'runner':>7} {'tok/s':>7} {'ops':>5}")
    for name, res in results.items():
        for key, row in res.items():
            if not key.startswith("b"):
                continue
            print(f"{name:<24} {key[1:]:>3} {row['step_ms']:7.2f} {row['step_p10_ms']:7.2f} {row['forward_ms']:7.2f} {row['logits_ms']:7.2f} "
                  f"{row['sample_ms']:7.2f} {row['host_ms']:7.2f} {row['runner_forward_ms']:7.2f} "
                  f"{row['tok_s']:7.1f} {row['aten_ops']['top_level']:5d}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
