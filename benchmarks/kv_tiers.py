"""KV tiers under pressure: LRU only vs + host tier vs + session retention vs + partial retraction.

    python benchmarks/kv_tiers.py --preset cpu --output-dir benchmarks/results/cpu/kv_tiers
    python benchmarks/kv_tiers.py --preset h200 --output-dir $OUT/kv_tiers --budget-s 290

Each configuration is a `tokenspeed serve` whose device pool (`--num-kv-pages`)
holds about a quarter of the concurrent sessions' working set (concurrency x
max context), driven by `tokenspeed bench serve --workload agentic
--session-key` (each session's id as `prompt_cache_key`), one after the other
in one run:

- `lru`: no host tier, no retention, preemption recomputes;
- `host`: + a host tier (write-back of evicted prefix pages, host hits);
- `host+retention`: + session retention (`--session-ttl`);
- `host+retention+retract`: + partial retraction (`--preemption-mode retract`).

Per configuration, from the per-request records: re-prefilled tokens (tokens
a turn could have reused from its session's previous turn but computed
again), the cache hit rate of those reusable tokens, all prompt tokens
prefilled, TTFT p50/p99, output TPS per user and total TPM per GPU of the
point (counted "at the floor" only when TPS/user >= 70), the server's
tier counters (`/debug/kv`) and the mean queue time of the requests (the
server's `tokenspeed_request_queue_time_seconds`) with its share of the mean
TTFT. The `bandwidth` section measures, in the same
run, a plain pinned host<->device copy and the engine's own batched tier
copies (`executor/kv_tiers.py`) on the preset's page layout, and their ratio.

Presets: `cpu` (the embedded model, 2K contexts, minutes on 2 cores) and
`h200` (the Qwen3-8B preset with dummy weights, sessions grown to 60K+
tokens). The agentic plan is shrunk from its native 128K window to the
preset's max context (`h200`: planned for a 128K window, `--plan-context`,
served with a 64K one, so that a quarter of the working set is a real
quarter of the sessions' 60K+ tokens, and the device pool can still hold one
max-length request; replies capped at 128 tokens, so that the run is about
prefill and reuse rather than decode), so sessions reach it only over many
turns (`--turns`; 24 turns grew them to only 55K on an H100, hence 28). A configuration that overruns its share of `--budget-s`
is reported from the requests that finished (`timed_out`, `requests_finished`).
On the H200 the LRU baseline re-prefills whole sessions, so split the run:
`--configs lru`, then the other three with `--merge-from` the first part's
kv_tiers.json (or the same `--output-dir`): the results merge into one file. `--budget-s` bounds the whole run: each configuration gets an equal
share and a bench that overruns it is stopped and reported as timed out.
Results: `kv_tiers.json` = {"command", "device", "date", "preset", "metrics"}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.bench.metrics import percentile
from tokenspeed.bench.pareto import TPS_FLOOR
from tokenspeed.executor.kv_tiers import HostKVTier
from tokenspeed.kvcache import CopyKind, CopyOp, KVLayout

PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(model=None, max_context=2048, page_size=16, concurrency=6, sessions=6, turns=36, time_scale=0.02,
                host_bytes=1 << 30, session_ttl=300, budget_s=1800, dtype="float32", extra=["--cpu-threads", "1"],
                layout=dict(layers=4, kv_heads=2, head_dim=32), copy_pages=256),
    "h200": dict(model="qwen3-8b", yarn_context=131072, max_context=73728, plan_context=131072, page_size=16,
                 concurrency=4, sessions=4, turns=28, reply_cap=128, time_scale=0.01, host_bytes=44 << 30,
                 session_ttl=300, budget_s=290, dtype="bfloat16",
                 extra=["--max-num-seqs", "16", "--cuda-graph-max-bs", "16"],
                 layout=dict(layers=36, kv_heads=8, head_dim=128), copy_pages=512),
}
CONFIGS: list[tuple[str, bool, bool, str]] = [  # name, host tier, retention, preemption mode
    ("lru", False, False, "recompute"),
    ("host", True, False, "recompute"),
    ("host+retention", True, True, "recompute"),
    ("host+retention+retract", True, True, "retract"),
]
RESULTS: dict[str, Any] = {}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save(path: Path, command: str, preset: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    doc = {"command": command, "device": device, "preset": preset,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "metrics": RESULTS}
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ---- bandwidth --------------------------------------------------------------------------------------


def _timed(fn: Any, device: torch.device, reps: int = 5) -> float:
    """Median seconds of `fn()` (synchronised on a GPU)."""
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def bandwidth_section(preset: dict[str, Any]) -> dict[str, Any]:
    """Pinned host<->device copy bandwidth, and the engine's tier copies on the preset's page layout."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    shape = preset["layout"]
    pages = preset["copy_pages"]
    storage = PagedKVStorage(num_layers=shape["layers"], num_pages=pages + 1, page_size=preset["page_size"],
                             num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], dtype=dtype, device=device)
    page_bytes = PagedKVStorage.bytes_per_page(num_layers=shape["layers"], page_size=preset["page_size"],
                                               num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], dtype=dtype)
    layout = KVLayout("bench", preset["dtype"], preset["page_size"], shape["layers"], page_bytes)
    tier = HostKVTier(storage, layout, pages, device)
    total = pages * page_bytes
    pinned = device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    d2h_raw = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    h2d_raw = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    step = [0]

    def engine_copy(kind: CopyKind) -> None:
        step[0] += 1
        ops = [CopyOp(i, kind, device_page=i, host_slot=i, page_hash=None) for i in range(pages)]
        tier.run(step[0], ops)
        tier.finished(step[0], wait_all=True)

    d2h = _timed(lambda: engine_copy(CopyKind.DEVICE_TO_HOST), device)
    h2d = _timed(lambda: engine_copy(CopyKind.HOST_TO_DEVICE), device)
    tier.close()
    gbps = {name: round(total / seconds / 1e9, 2) for name, seconds in
            (("pinned_d2h_gbps", d2h_raw), ("pinned_h2d_gbps", h2d_raw),
             ("engine_d2h_gbps", d2h), ("engine_h2d_gbps", h2d))}
    return {"pages": pages, "page_bytes": page_bytes, "batch_bytes": total, **gbps,
            "engine_d2h_fraction_of_pinned": round(gbps["engine_d2h_gbps"] / gbps["pinned_d2h_gbps"], 3),
            "engine_h2d_fraction_of_pinned": round(gbps["engine_h2d_gbps"] / gbps["pinned_h2d_gbps"], 3)}


# ---- one configuration ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(url: str, server: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def long_context_preset(name: str, context: int, folder: Path) -> Path:
    """The preset's folder with Qwen's documented YaRN rope scaling to `context` (Qwen3-8B is 40K natively;
    its model card extends it to 128K this way): the sessions must reach 60K+ tokens."""
    from tokenspeed.engine.model_files import resolve_model_folder

    source = resolve_model_folder(name)
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((source / "config.json").read_text())
    native = min(config["max_position_embeddings"], 32768)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": context / native, "original_max_position_embeddings": native}
    config["max_position_embeddings"] = context
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def num_kv_pages(preset: dict[str, Any]) -> int:
    """A quarter of the concurrent sessions' working set, and at least one max-length request."""
    size = preset["page_size"]
    working_set = preset["concurrency"] * math.ceil(preset["max_context"] / size)
    return max(working_set // 4, math.ceil(preset["max_context"] / size))


def reuse_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Re-prefilled tokens and the hit rate of reusable tokens (a turn's share of its previous turn)."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("error") is None and record.get("usage_reported"):
            by_session.setdefault(record["session_id"], []).append(record)
    reusable = hit = reprefilled = prefilled = prompts = 0
    longest = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for previous, current in zip([None, *turns], turns, strict=False):
            prompts += current["prompt_tokens"]
            prefilled += current["prompt_tokens"] - current["cached_tokens"]
            longest = max(longest, current["prompt_tokens"] + current["output_tokens"])
            if previous is None or previous["turn"] != current["turn"] - 1:
                continue
            could = min(current["prompt_tokens"], previous["prompt_tokens"] + previous["output_tokens"])
            reusable += could
            hit += min(current["cached_tokens"], could)
            reprefilled += max(0, could - current["cached_tokens"])
    return {"reusable_tokens": reusable, "reprefilled_tokens": reprefilled,
            "reusable_hit_rate": round(hit / reusable, 4) if reusable else None,
            "prompt_tokens": prompts, "prefilled_tokens": prefilled, "longest_context_tokens": longest}


def queue_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the server's `tokenspeed_request_queue_time_seconds` histogram."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "tokenspeed_request_queue_time_seconds":
            values = {s.name: s.value for s in family.samples if not s.labels or "le" not in s.labels}
            return values[family.name + "_sum"], values[family.name + "_count"]
    return 0.0, 0.0


def queue_share(records: list[dict[str, Any]], before: tuple[float, float], after: tuple[float, float]) -> dict[str, Any]:
    """Mean queue time of the bench's requests (scheduler: submit to admission) and its share of mean TTFT.

    Under a pool that holds one long request at a time the agents take turns, and the wait for the
    pool, not the request's own restore or prefill, can make most of its TTFT: this says how much.
    """
    count = after[1] - before[1]
    ttfts = [r["ttft_s"] for r in records if r.get("error") is None and r.get("ttft_s") is not None]
    if not count or not ttfts:
        return {}
    queue_ms = (after[0] - before[0]) / count * 1e3
    ttft_ms = sum(ttfts) / len(ttfts) * 1e3
    return {"queue_time_mean_ms": round(queue_ms, 1), "ttft_mean_ms": round(ttft_ms, 1),
            "queue_share_of_ttft": round(queue_ms / ttft_ms, 3) if ttft_ms else None}


def _percentile(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 1) if values else None


def run_config(name: str, host: bool, retention: bool, mode: str, preset: dict[str, Any], out_dir: Path,
               timeout_s: float) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port),
            "--max-model-len", str(preset["max_context"]), "--page-size", str(preset["page_size"]),
            "--num-kv-pages", str(num_kv_pages(preset)),
            "--host-kv-cache-bytes", str(preset["host_bytes"] if host else 0),
            "--session-ttl", str(preset["session_ttl"] if retention else 0), "--preemption-mode", mode,
            "--uvicorn-log-level", "warning", *preset["extra"]]
    if preset["model"]:
        args += ["--model", preset["model"]]
    if preset.get("load_format"):
        args += ["--load-format", preset["load_format"]]
    folder = out_dir / name.replace("+", "_")
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "serve.log"
    row: dict[str, Any] = {"num_kv_pages": num_kv_pages(preset), "host_kv_cache_bytes": preset["host_bytes"] if host else 0,
                           "session_ttl": preset["session_ttl"] if retention else 0, "preemption_mode": mode}
    with log_path.open("w") as log_file:
        server = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
        started = time.monotonic()
        try:
            _wait_ready(url, server, log_path)
            bench = [sys.executable, "-m", "tokenspeed.cli", "bench", "serve", "--base-url", url,
                     "--output-dir", str(folder), "--workload", "agentic", "--concurrency", str(preset["concurrency"]),
                     "--sessions", str(preset["sessions"]), "--turns", str(preset["turns"]),
                     "--max-context", str(preset["max_context"]), "--time-scale", str(preset["time_scale"]),
                     *(["--plan-context", str(preset["plan_context"])] if preset.get("plan_context") else []),
                     *(["--output-len", str(preset["reply_cap"])] if preset.get("reply_cap") else []),
                     "--label", name, "--session-key", "--ignore-eos", "--no-progress", "--no-calibrate"]
            queue_before = queue_seconds(url)
            left = max(30.0, timeout_s - (time.monotonic() - started))
            try:
                subprocess.run(bench, check=True, timeout=left, stdout=subprocess.DEVNULL)
                row["timed_out"] = False
            except subprocess.TimeoutExpired:
                row["timed_out"] = True
            tiers = httpx.get(url + "/debug/kv", timeout=10).json().get("kv_tiers", {})
            queue_after = queue_seconds(url)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    records = [json.loads(line) for path in folder.glob("requests-*.jsonl") for line in path.read_text().splitlines()]
    row.update(reuse_metrics(records))
    row.update(queue_share(records, queue_before, queue_after))
    row["tier_counters"] = tiers.get("counters", {})
    if row["timed_out"]:  # what the requests that finished say (the bench writes each as it ends)
        ttfts = sorted(r["ttft_s"] * 1e3 for r in records if r.get("error") is None and r.get("ttft_s") is not None)
        row.update({"requests_finished": len(records), "ttft_p50_ms": _percentile(ttfts, 50),
                    "ttft_p99_ms": _percentile(ttfts, 99)})
        return row
    result = json.loads((folder / "results.json").read_text())
    point = result["rows"][0] if isinstance(result, dict) else result[0]
    row.update({"ttft_p50_ms": point.get("ttft_p50_ms"), "ttft_p99_ms": point.get("ttft_p99_ms"),
                "tps_per_user": point.get("tps_per_user"), "total_tpm_per_gpu": point.get("total_tpm_per_gpu"),
                "errors": point.get("errors"), "requests": point.get("requests")})
    tps = point.get("tps_per_user") or 0.0
    row["tpm_per_gpu_at_floor"] = point.get("total_tpm_per_gpu") if tps >= TPS_FLOOR else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=None, help="bound of the whole run (default: the preset's)")
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS), help="comma-separated subset")
    parser.add_argument("--turns", type=int, default=None, help="turns per session (default: the preset's)")
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent sessions (default: the preset's)")
    parser.add_argument("--host-bytes", type=int, default=None, help="host tier bytes (default: the preset's)")
    parser.add_argument("--merge-from", type=Path, default=None,
                        help="a kv_tiers.json of an earlier part of a split run, whose configurations are kept")
    args = parser.parse_args(argv)
    command = " ".join(["python", "benchmarks/kv_tiers.py", *(argv if argv is not None else sys.argv[1:])])
    preset = dict(PRESETS[args.preset])
    if args.turns is not None:
        preset["turns"] = args.turns
    if args.concurrency is not None:
        preset["concurrency"] = preset["sessions"] = args.concurrency
    if args.host_bytes is not None:
        preset["host_bytes"] = args.host_bytes
    out = args.output_dir / "kv_tiers.json"
    for earlier in (args.merge_from, out):  # a run split over several commands (--configs) adds to one file
        if earlier is not None and earlier.exists():
            previous = json.loads(earlier.read_text())
            if previous.get("preset") == args.preset:
                RESULTS.update(previous["metrics"])
    budget = args.budget_s or preset["budget_s"]
    started = time.monotonic()
    if preset.get("yarn_context"):
        preset["model"] = str(long_context_preset(preset["model"], preset["yarn_context"],
                                                  args.output_dir / "model"))
        preset["load_format"] = "dummy"
    RESULTS["setup"] = {k: v for k, v in preset.items() if k != "extra"} | {"num_kv_pages": num_kv_pages(preset)}
    RESULTS["bandwidth"] = bandwidth_section(preset)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the servers started next get the device's memory
    log(f"bandwidth: {RESULTS['bandwidth']}")
    save(out, command, args.preset)
    wanted = args.configs.split(",")
    configs = [c for c in CONFIGS if c[0] in wanted]
    for i, (name, host, retention, mode) in enumerate(configs):
        share = (budget - (time.monotonic() - started)) / (len(configs) - i)
        RESULTS[name] = run_config(name, host, retention, mode, preset, args.output_dir, share)
        log(f"{name}: {RESULTS[name]}")
        save(out, command, args.preset)
    lru, best = RESULTS.get("lru", {}), RESULTS.get("host+retention", {})
    if lru.get("ttft_p99_ms") and best.get("ttft_p99_ms"):
        RESULTS["ttft_p99_lru_over_host_retention"] = round(lru["ttft_p99_ms"] / best["ttft_p99_ms"], 2)
    save(out, command, args.preset)
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
