"""What the smg gateway costs and what a second replica buys, in one run.

Three servers of the same model, started one after the other, each driven by
the same `tokenspeed bench serve` workload (agentic sessions, so prefix
reuse and session stickiness matter):

* `fastapi-1`: `tokenspeed serve` (our FastAPI server, one replica);
* `smg-1`: `tokenspeed serve --gateway smg --data-parallel-size 1`;
* `smg-2`: `tokenspeed serve --gateway smg --data-parallel-size 2`.

fastapi-1 vs smg-1 is the gateway's overhead (HTTP, templating and
tokenising in smg, one gRPC hop); smg-1 vs smg-2 is the scaling. Results
(one row per label x concurrency, with TTFT, throughput, the client-side
cache hit rate and, behind smg, each replica's own hit rate) go to
`--output-dir` as results.csv/json, with a summary.md that names the command.

    .venv/bin/python benchmarks/gateway_overhead.py --output-dir benchmarks/results/cpu/gateway
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CONFIGS = {
    "fastapi-1": [],
    "smg-1": ["--gateway", "smg", "--data-parallel-size", "1"],
    "smg-2": ["--gateway", "smg", "--data-parallel-size", "2"],
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(label: str, extra: list[str], serve_args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port), *serve_args, *extra]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=1).json().get("data"):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{label} did not start; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _summary(out_dir: Path, command: str) -> str:
    rows = json.loads((out_dir / "results.json").read_text())["rows"]
    lines = [
        "# Gateway overhead and scaling (CPU, embedded model)",
        "",
        f"Command: `{command}`",
        "",
        "| label | concurrency | requests | errors | TTFT p50 ms | TTFT mean ms | TPOT p50 ms | output tok/s "
        "| requests/s | cache hit (client) | cache hit per replica (since start) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (list(CONFIGS).index(r["label"]), r["concurrency"])):
        replicas = row.get("replica_cache_hit_rate") or {}
        per_replica = ", ".join(f"{v:.2f}" for _, v in sorted(replicas.items())) or "-"
        lines.append(
            f"| {row['label']} | {row['concurrency']} | {row['requests']} | {row['errors']} "
            f"| {row['ttft_p50_ms']:.1f} | {row['ttft_mean_ms']:.1f} | {row['tpot_p50_ms']:.1f} "
            f"| {row['output_tokens_per_s']:.1f} | {row['request_throughput']:.2f} | {row['cache_hit_rate']:.2f} "
            f"| {per_replica} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated labels to run")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--model", default=None, help="model or preset (default: the embedded model)")
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    serve_args = ["--max-model-len", str(args.max_model_len), "--disable-access-log"]
    if args.model is not None:
        serve_args += ["--model", args.model]
    for label in args.configs.split(","):
        proc, url = _start(label, CONFIGS[label], serve_args, args.output_dir / f"server-{label}.log")
        try:
            bench = [sys.executable, "-m", "tokenspeed.cli", "bench", "serve", "--base-url", url,
                     "--label", label, "--workload", "agentic", "--concurrency", args.concurrency,
                     "--sessions", str(args.sessions), "--turns", str(args.turns),
                     "--max-context", str(args.max_model_len), "--time-scale", "0.05", "--seed", "0",
                     "--ignore-eos", "--no-progress", "--output-dir", str(args.output_dir)]
            print(f"== {label}: {shlex.join(bench[2:])}", flush=True)
            subprocess.run(bench, check=True, env={**os.environ, "COLUMNS": "200"})
        finally:
            _stop(proc)
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    (args.output_dir / "summary.md").write_text(_summary(args.output_dir, command))
    print((args.output_dir / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
