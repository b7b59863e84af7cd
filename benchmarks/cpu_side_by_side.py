"""What `cpu_decode_step.py` and `cpu_prefill_step.py` share: the step probe and the side-by-side driver.

Both scripts time the engine step and its parts in-process (`StepProbe`), and both compare checkouts
(`--tree NAME=PATH`) and LLM keyword arguments (`--variant NAME=JSON`) by running one subprocess per
(tree, variant) per round, interleaved round by round so background load hits all alike, keeping the
best round per config and writing the results with the command (`run_side_by_side`). This module holds
that once; each script keeps only what it measures, how it picks its best round and its tables.

The child subprocess runs the calling script of this checkout with `PYTHONPATH` set to the measured
tree, so only `tokenspeed` comes from that tree: this module need not exist there. benchmarks/ is not a
package: the scripts put their own folder on `sys.path` and import this module by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StepProbe:
    """Wraps the engine's step, the model's forward and LM head, the runner's CPU forward and its sampler
    with timers: per engine step a dict of seconds (`step`, `forward`, `logits`, `sample`) in `steps`.
    Subclasses see each forward's batch in `note_batch`."""

    def __init__(self, llm: Any) -> None:
        core = llm.core
        runner = core.executor.runner
        self.runner = runner
        self.model = runner.model
        self.current: dict[str, Any] = {}
        self.steps: list[dict[str, Any]] = []

        forward = self.model.forward

        def model_forward(batch: Any, kv: Any) -> Any:
            self.note_batch(batch)
            return forward(batch, kv)

        self.model.forward = self.timed("forward", model_forward)
        self.model.compute_logits = self.timed("logits", self.model.compute_logits)
        runner._sample = self.timed("sample", runner._sample)
        fast = getattr(runner, "cpu_decode", None)  # the CPU forward, where present
        if fast is not None:
            run = fast.run

            def fast_run(batch: Any, **kwargs: Any) -> Any:
                self.note_batch(batch)
                return run(batch, **kwargs)

            fast.run = self.timed("forward", fast_run)
            if getattr(fast, "lm_head", None) is not None:  # its own (pre-packed) LM head, else compute_logits
                fast.logits = self.timed("logits", fast.logits)
        step = core.step

        def core_step() -> Any:
            self.current = {}
            t0 = time.perf_counter()
            out = step()
            self.current["step"] = time.perf_counter() - t0
            self.steps.append(self.current)
            return out

        core.step = core_step

    def timed(self, name: str, fn: Any) -> Any:
        """`fn`, adding its wall time to the current step's `name`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    def note_batch(self, batch: Any) -> None:
        """Called with each forward's batch before it runs."""

    @staticmethod
    def host_seconds(step: dict[str, Any]) -> float:
        """The step's time outside the forward, LM head and sampler."""
        return step["step"] - step.get("forward", 0.0) - step.get("logits", 0.0) - step.get("sample", 0.0)


def build_llm(llm_kwargs: dict[str, Any], max_model_len: int, max_num_seqs: int) -> Any:
    """The engine as both scripts measure it (one torch thread, seed 0), `llm_kwargs` on top."""
    from tokenspeed import LLM

    kwargs: dict[str, Any] = dict(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        cpu_threads=1,
        show_progress=False,
        seed=0,
    )
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


def add_driver_arguments(parser: argparse.ArgumentParser, default_out: Path) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout to measure")
    parser.add_argument("--variant", action="append", default=[], help="NAME=JSON of LLM keyword arguments")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON LLM kwargs: measure once, print JSON
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)


def run_side_by_side(
    script: str,
    args: argparse.Namespace,
    forwarded: list[str],
    measure: Callable[[argparse.Namespace, dict[str, Any], int], dict[str, Any]],
    best_of: Callable[[list[dict[str, Any]]], dict[str, Any]],
    round_summary: Callable[[dict[str, Any]], str],
    print_results: Callable[[dict[str, Any]], None],
) -> None:
    """With `--child`: one `measure`, printed as JSON. Otherwise `script` (with `forwarded` arguments) in a
    subprocess per config per round, interleaved (`round_summary` of each printed); per config `best_of`
    its rounds, written with the command to `args.out` and shown by `print_results`."""
    if args.child is not None:
        print("RESULT " + json.dumps(measure(args, json.loads(args.child), args.seed)), flush=True)
        return
    script_path = Path(script).resolve()
    repo = script_path.parent.parent
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("current", str(repo))]
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [("default", "{}")]
    configs = [(f"{t}" if len(variants) == 1 else f"{t}/{v}" if len(trees) > 1 else v, path, kw)
               for t, path in trees for v, kw in variants]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    for r in range(args.rounds):
        for name, path, kw in configs:
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()), OMP_NUM_THREADS="1")
            proc = subprocess.run(
                [sys.executable, str(script_path), *forwarded, "--child", kw, "--seed", str(r)],
                env=env, capture_output=True, text=True, check=False,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise SystemExit(f"{name} failed in round {r}")
            rounds[name].append(json.loads(line.removeprefix("RESULT ")))
            print(f"round {r} {name}: {round_summary(rounds[name][-1])}", flush=True)
    results = {name: best_of(rs) for name, rs in rounds.items()}
    document = {
        "command": "python " + " ".join([str(script_path.relative_to(repo)), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "configs": {name: {"tree": path, "llm_kwargs": json.loads(kw)} for name, path, kw in configs},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print_results(results)
    print(f"written to {args.out}")
