"""Host time of a speculative step against batch size: drafting, scheduling, verify bookkeeping (no model).

    python benchmarks/spec_host_overhead.py [--batch-sizes 1 4 16 64] [--k 15] [--steps 64]

Why: on the H200 `suffix` (15 drafts) helped at one user and hurt at 64
concurrent ones; the host work of a step that carries drafts grows with the
batch (the suffix drafter matches per row, every verify row gets k+1 sampling
specs, the scheduler records each row's acceptance), and a step's host time is
paid before its forward. This measures that work alone at R concurrent
requests, speculation off and on, on the agent-edit and tool-call replays of
`benchmarks/spec_drafters.py` (the "model" emits each request's known output,
drafts are verified greedily against it, a finished request is replaced by the
next job, so the batch stays full).

Per step, mean over `--steps` steps at steady state: `scheduler_ms`
(`next_plan` + `advance`, drafting included), `drafter_ms` (inside the
drafter's `propose`), `executor_host_ms` (the runner's host work for the plan:
`lay_out`, `build_host_batch`, and for verify rows `verify_batch`, the sampler's
processing and the verifier, on logits of a 64-token vocabulary on the CPU)
and their sum `host_ms`; `draft_tokens_per_step`, `tokens_per_step` (emitted).
`--verify-pad-length K --max-verify-tokens 512` prices drafting steps as the
engine on an H200 does (verify rows padded to K drafts, graphs up to 512
tokens: `scheduler/speculation.py`); without them, as on the CPU.
Results: `benchmarks/results/cpu/spec/spec_host_overhead.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from spec_drafters import TOKENIZER, ReplayExecutor, TimedDrafter, workloads
from tokenizers import Tokenizer

from tokenspeed.executor.batch_builder import RowSpec, build_host_batch
from tokenspeed.executor.page_tables import RequestPageTables
from tokenspeed.executor.sampler import Sampler
from tokenspeed.executor.step_layout import lay_out
from tokenspeed.executor.verify_step import process_verified, verify_batch
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.spec import parse_speculative_config
from tokenspeed.spec.speculator import SpeculativeDecoder

RESULTS = Path(__file__).parent / "results" / "cpu" / "spec" / "spec_host_overhead.json"
PAGE_SIZE = 16


def args_k(spec: dict[str, Any] | None) -> int:
    return 1 if spec is None else int(spec["num_speculative_tokens"])


def measure(batch_size: int, spec: dict[str, Any] | None, steps: int, jobs: list[Any],
            pricing: dict[str, int | None] | None = None) -> dict[str, float]:
    """`pricing`: the `DraftPolicy` fields a GPU engine sets (`verify_pad_length`, `max_verify_tokens`)."""
    config = parse_speculative_config(spec)
    drafter = None if config is None else config.make_drafter()
    timed = None if drafter is None else TimedDrafter(drafter)
    policy = None if config is None else config.draft_policy()
    if policy is not None and pricing:
        policy = dataclasses.replace(policy, **pricing)  # type: ignore[arg-type]
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=batch_size, max_num_batched_tokens=8192, max_model_len=32768, page_size=PAGE_SIZE,
        num_pages=batch_size * 32768 // PAGE_SIZE, speculation=policy), timed)
    executor = ReplayExecutor()
    tables = RequestPageTables(torch.device("cpu"), scratch_page=scheduler.config.num_pages)
    sampler, verifier = Sampler(), SpeculativeDecoder(args_k(spec))
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        job = jobs[submitted % len(jobs)]
        request_id = f"r{submitted}"
        executor.outputs[request_id] = job.output
        scheduler.submit(request_id, list(job.prompt), SamplingParams(temperature=0.0, max_tokens=len(job.output)))
        submitted += 1

    for _ in range(batch_size):
        submit()
    totals = {"scheduler_ms": 0.0, "drafter_ms": 0.0, "executor_host_ms": 0.0}
    timed_steps, drafted, emitted = 0, 0, 0
    warmup = 0
    gc.collect()
    while timed_steps < steps:
        if timed is not None:
            timed.seconds = 0.0
        start = time.perf_counter()
        plan = scheduler.next_plan()
        planned = time.perf_counter()
        slots = tables.apply(plan)
        layout = lay_out(plan)
        build_host_batch([RowSpec(tokens, r.start_position) for tokens, r in zip(layout.tokens, plan.rows)],
                         PAGE_SIZE, layout.logits_indices, tables=tables, table_slots=slots)
        if layout.verify_rows:  # the runner's verify bookkeeping, on logits of a small vocabulary
            batch = verify_batch(plan, layout, None, torch.device("cpu"), fast_greedy=verifier.fast_greedy_verify)
            processed, _ = process_verified(sampler, torch.zeros(len(batch.position_specs), 64), batch, None)
            verifier.verify(processed, batch, sampler)
        laid_out = time.perf_counter()
        result = executor.run(plan)
        resumed = time.perf_counter()
        updates = scheduler.advance(plan, result)
        done = time.perf_counter()
        finished = sum(1 for u in updates if u.finished)
        for _ in range(finished):
            submit()
        decoding = all(len(r.input_token_ids) == 1 for r in plan.rows) and len(plan.rows) == batch_size
        if not decoding or warmup < 8:
            warmup += decoding
            continue
        timed_steps += 1
        totals["scheduler_ms"] += 1e3 * ((planned - start) + (done - resumed))
        totals["executor_host_ms"] += 1e3 * (laid_out - planned)
        totals["drafter_ms"] += 1e3 * (timed.seconds if timed is not None else 0.0)
        drafted += sum(r.num_draft_tokens for r in plan.rows)
        emitted += sum(len(u.new_token_ids) for u in updates)
    row = {key: round(value / steps, 4) for key, value in totals.items()}
    row["host_ms"] = round(row["scheduler_ms"] + row["executor_host_ms"], 4)
    row["draft_tokens_per_step"] = round(drafted / steps, 2)
    row["tokens_per_step"] = round(emitted / steps, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--k", type=int, default=15, help="num_speculative_tokens of suffix")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--verify-pad-length", type=int, default=None,
                        help="price steps as a GPU engine does: verify rows padded to this many drafts (k)")
    parser.add_argument("--max-verify-tokens", type=int, default=None,
                        help="... and its largest verify graph (tokens); the H200 engine: 512")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    pricing = {key: value for key, value in (("verify_pad_length", args.verify_pad_length),
                                             ("max_verify_tokens", args.max_verify_tokens)) if value is not None}
    every = workloads(Tokenizer.from_file(str(TOKENIZER)))
    jobs = [job for name in ("edit", "tool_json") for session in every[name] for job in session]
    metrics: dict[str, Any] = {}
    for bs in args.batch_sizes:
        for name, spec in (("off", None), ("suffix", {"method": "suffix", "num_speculative_tokens": args.k})):
            row = measure(bs, spec, args.steps, jobs, pricing)
            metrics[f"bs{bs}/{name}"] = row
            print(f"bs{bs} {name}: {row}", flush=True)
    body = {
        "command": " ".join(["python", "benchmarks/spec_host_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": f"CPU ({platform.processor() or platform.machine()}), Python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
