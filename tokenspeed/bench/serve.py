"""`tokenspeed bench serve`: sweep concurrency against any OpenAI-compatible server.

Order of a run: ask the server what it serves (`/v1/models`), calibrate its
tokenizer from the outside (`calibrate.py`), plan the workload in tokens and
shrink it to `--max-context`, warm the shared system prefix once (a deployed
agent fleet always has it hot; a cold first request would only measure our
start order), then play every concurrency point with fresh session text and
write results.csv / results.json / requests-LABEL.jsonl / summary.txt (the full
table; the terminal shows its main columns) / pareto.png.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path
from typing import Any

import httpx

from tokenspeed.bench.agentic import agentic_plan
from tokenspeed.bench.calibrate import (
    calibrate,
    replica_cache_hit_rates,
    server_info,
    speculation_counters,
    speculation_summary,
    vocabulary_warning,
)
from tokenspeed.bench.client import RequestOptions, RequestRecord, stream_request
from tokenspeed.bench.conversation import TextRatios, system_text
from tokenspeed.bench.fixed import SWE_SMITH_FIRST_TURN, SWE_SMITH_TURN_TOKENS, random_plan, swe_smith_plan
from tokenspeed.bench.metrics import summarize
from tokenspeed.bench.pareto import plot_pareto
from tokenspeed.bench.report import make_progress, print_summary, write_summary
from tokenspeed.bench.results_io import append_request, requests_path, write_requests, write_rows
from tokenspeed.bench.sweep import PointRun, PointSpec, run_point
from tokenspeed.bench.workload import WorkloadPlan, cap_replies, fit_to_context

WORKLOADS = ("agentic", "swe-smith", "random")


def parse_concurrency(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency wants positive integers like 1,2,4: {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="concurrency sweep against an OpenAI-compatible server")
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    parser.add_argument("--workload", choices=WORKLOADS, default="agentic", help="session shape (default: %(default)s)")
    parser.add_argument("--concurrency", type=parse_concurrency, default=[1, 2, 4, 8, 16],
                        help="comma-separated concurrent sessions per point (default: 1,2,4,8,16)")
    parser.add_argument("--sessions", type=int, default=16, help="sessions per point (at least the concurrency) (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=None,
                        help="turns per session (default: agentic 10-40 heavy-tailed, swe-smith 10-15, random 1)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, required=True,
                        help="where results.csv/json and pareto.png go (required)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="shrink every session proportionally so each prompt + reply fits "
                             "(default: the max_model_len the server reports, if any)")
    parser.add_argument("--plan-context", type=int, default=None,
                        help="shrink the sessions to this window instead (may exceed the server's): sessions "
                             "grow as for a longer context and end when their next turn would not fit the server")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to always generate max_tokens")
    parser.add_argument("--session-key", action="store_true",
                        help="send each session's id as prompt_cache_key (a server's session retention key)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply tool/think gaps (0: none) (default: %(default)s)")
    parser.add_argument("--label", default=None, help="curve name (default: the model name)")
    parser.add_argument("--gpus", type=int, default=1, help="divide per-GPU throughput by this (default: %(default)s)")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat", help="endpoint to drive (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=None, help="random/swe-smith: reply tokens (128/256); agentic: the most a reply may take")
    parser.add_argument("--first-turn-len", type=int, default=SWE_SMITH_FIRST_TURN, help="swe-smith: first turn (default: %(default)s)")
    parser.add_argument("--turn-len", type=int, default=SWE_SMITH_TURN_TOKENS, help="swe-smith: tokens per turn (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    parser.add_argument("--no-calibrate", action="store_true", help="use default chars/token, skip probing")
    parser.add_argument("--no-progress", action="store_true", help="no live progress display")
    parser.set_defaults(handler=run)


def build_plan(args: argparse.Namespace, sessions: int) -> WorkloadPlan:
    """The native-scale plan of `sessions` sessions for the chosen workload."""
    if args.workload == "agentic":
        plan = agentic_plan(sessions, args.seed, args.turns)
        return plan if args.output_len is None else cap_replies(plan, args.output_len)
    if args.workload == "swe-smith":
        return swe_smith_plan(sessions, args.seed, args.turns, args.first_turn_len, args.turn_len,
                              args.output_len or 256)
    return random_plan(sessions, args.turns, args.input_len, args.output_len or 128)


async def _warm_up(http: httpx.AsyncClient, options: RequestOptions, prefix_text: str) -> None:
    messages = ([{"role": "system", "content": prefix_text}] if prefix_text else []) + [{"role": "user", "content": "x"}]
    await stream_request(http, options, messages, 1, RequestRecord("warm-up", 0))


def _metadata(args: argparse.Namespace, label: str, model: str, info: dict[str, Any],
              plan: WorkloadPlan, ratios: TextRatios, max_context: int | None) -> dict[str, Any]:
    return {
        "label": label,
        "workload": args.workload,
        "model": model,
        "api": args.api,
        "base_url": args.base_url,
        "gpus": args.gpus,
        "seed": args.seed,
        "max_context": max_context,
        "plan_context": args.plan_context,
        "time_scale": args.time_scale,
        "ignore_eos": args.ignore_eos,
        "shape_scale": plan.scale,
        "prefix_tokens": plan.prefix_tokens,
        "chars_per_token": {"system": ratios.system, "task": ratios.task, "tool": ratios.tool},
        "turn_overhead_tokens": ratios.turn_overhead,
        "server": info,
        "command": args.command_line,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


async def sweep(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[PointRun]]:
    """Run every concurrency point; returns this run's result rows and raw point runs."""
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, max_keepalive_connections=max(args.concurrency) + 8)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as http:
        info = await server_info(http)
        vocabulary = vocabulary_warning(info)
        if vocabulary is not None:
            print(f"warning: {vocabulary}", file=sys.stderr)
        model = args.model or next(iter(info.get("models") or []), None)
        if model is None:
            reason = info.get("models_error") or "it lists no model; pass --model"
            raise RuntimeError(f"cannot pick a model at {args.base_url}: {reason}")
        options = RequestOptions(model, args.api, args.temperature, args.ignore_eos, args.session_key)
        windows = [w for w in (args.max_context, info.get("max_model_len")) if w]
        max_context = min(windows) if windows else None
        ratios = TextRatios() if args.no_calibrate else await calibrate(http, options, max_context)
        needed = max(args.sessions, max(args.concurrency))
        plan = fit_to_context(build_plan(args, needed), args.plan_context or max_context, ratios.turn_overhead)
        prefix_text = system_text(args.seed, plan.prefix_tokens, ratios) if plan.prefix_tokens else ""
        await _warm_up(http, options, prefix_text)
        metadata = _metadata(args, args.label or model, model, info, plan, ratios, max_context)
        requests_path(args.output_dir, metadata["label"]).unlink(missing_ok=True)

        rows: list[dict[str, Any]] = []
        runs: list[PointRun] = []
        with make_progress(not args.no_progress) as progress:
            for concurrency in args.concurrency:
                sessions = plan.sessions[: max(args.sessions, concurrency)]
                spec = PointSpec(plan, sessions, concurrency, ratios, prefix_text,
                                 salt=f"{args.seed}:c{concurrency}", time_scale=args.time_scale,
                                 max_context=max_context)
                total = sum(len(s.turns) for s in sessions)
                task = progress.add_task(f"C={concurrency}", total=total, status="")
                tokens = {"out": 0, "err": 0}

                def on_record(record: RequestRecord, task: Any = task, tokens: dict[str, int] = tokens,
                              concurrency: int = concurrency) -> None:
                    append_request(args.output_dir, metadata["label"], concurrency, record)
                    tokens["out"] += record.output_tokens
                    tokens["err"] += 0 if record.ok else 1
                    progress.update(task, advance=1, status=f"{tokens['out']} out tok, {tokens['err']} err")

                counters = await speculation_counters(http)
                run = await run_point(http, options, spec, on_record)
                # Turns a session skipped (cut or failed) never arrive: complete the bar.
                progress.update(task, completed=total)
                metrics = summarize(run.records, concurrency, len(sessions), run.duration_s, args.gpus)
                row = {**metadata, **metrics.flat(), "sessions_cut": run.sessions_cut}
                row.update(speculation_summary(counters, await speculation_counters(http)))
                rates = await replica_cache_hit_rates(http)
                if rates is not None:  # behind a gateway: does each session stay where its prefix is?
                    row["replica_cache_hit_rate"] = rates
                rows.append(row)
                runs.append(run)
    return rows, runs


def run(args: argparse.Namespace) -> int:
    try:
        rows, runs = asyncio.run(sweep(args))
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir: Path = args.output_dir
    merged = write_rows(out_dir, rows)
    label = rows[0]["label"]
    write_requests(out_dir, label, [(r.concurrency, r.records) for r in runs])
    plot_pareto(merged, out_dir / "pareto.png", title=f"{args.workload} workload")
    title = f"bench serve: {args.workload} vs {args.base_url}"
    print_summary(rows, title=title)
    write_summary(rows, out_dir / "summary.txt", title=title)
    print(f"results in {out_dir}: results.csv, results.json, summary.txt, pareto.png, requests-*.jsonl")
    failed = [r["concurrency"] for r in rows if r["requests"] and r["errors"] == r["requests"]]
    if failed:
        print(f"error: every request failed at concurrency {failed}", file=sys.stderr)
        return 1
    return 0
