"""Summarise a `run.sh` run: summary.json {"command", "date", "metrics"} and summary.md.

usage: summarize.py OUT_DIR VLLM_LABEL COMMAND

Metrics per concurrency C from vLLM's `bench serve` result files (`vllm-bench/LABEL-cC-rR.json`), the
best of each server's rounds (background load only ever slows a round down): output tok/s, mean TTFT
and TPOT of both servers and `output_tok_s_ratio_vs_vllm_cC` (ours / vLLM's), and every round's tok/s;
from the agentic sweep (`agentic/results.json`): total TPM and TPS/user per label and concurrency.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

CONCURRENCY = (1, 4, 16)
FIELDS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed")


def main(out_dir: Path, vllm_label: str, command: str) -> None:
    metrics: dict[str, float] = {}
    rows = []
    for c in CONCURRENCY:
        per: dict[str, dict[str, float]] = {}
        for label in ("tokenspeed", vllm_label):
            rounds = [json.loads(path.read_text()) for path in sorted((out_dir / "vllm-bench").glob(f"{label}-c{c}-r*.json"))]
            for i, result in enumerate(rounds, 1):
                metrics[f"{'tokenspeed' if label == 'tokenspeed' else 'vllm'}_output_tok_s_c{c}_round{i}"] = round(
                    float(result["output_throughput"]), 2
                )
            best = max(rounds, key=lambda result: float(result["output_throughput"]))  # the least disturbed round
            per[label] = {f: float(best[f]) for f in FIELDS}
            key = "tokenspeed" if label == "tokenspeed" else "vllm"
            metrics[f"{key}_output_tok_s_c{c}"] = round(per[label]["output_throughput"], 2)
            metrics[f"{key}_mean_tpot_ms_c{c}"] = round(per[label]["mean_tpot_ms"], 2)
            metrics[f"{key}_mean_ttft_ms_c{c}"] = round(per[label]["mean_ttft_ms"], 2)
        ratio = per["tokenspeed"]["output_throughput"] / per[vllm_label]["output_throughput"]
        metrics[f"output_tok_s_ratio_vs_vllm_c{c}"] = round(ratio, 3)
        rows.append((c, per["tokenspeed"], per[vllm_label], ratio))
    agentic_path = out_dir / "agentic" / "results.json"
    agentic_lines = []
    if agentic_path.exists():
        for row in json.loads(agentic_path.read_text())["rows"]:
            key = "tokenspeed" if row["label"] == "tokenspeed" else "vllm"
            c = row["concurrency"]
            metrics[f"agentic_{key}_total_tpm_c{c}"] = round(row["total_tpm_per_gpu"])
            metrics[f"agentic_{key}_tps_user_c{c}"] = round(row["tps_per_user"], 1)
            agentic_lines.append(
                f"| {row['label']} | {c} | {row['total_tpm_per_gpu'] / 1000:.0f}K | {row['cache_hit_rate']:.0%} |"
            )
    summary = {"command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "metrics": metrics}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# TokenSpeed vs {vllm_label} (random 512 in / 64 out, --ignore-eos, vLLM's bench serve client, best of 2 rounds)",
        "",
        "| C | output tok/s ours / vLLM | ratio | mean TTFT ms ours / vLLM | mean TPOT ms ours / vLLM |",
        "|---|---|---|---|---|",
    ]
    for c, ours, theirs, ratio in rows:
        lines.append(
            f"| {c} | {ours['output_throughput']:.1f} / {theirs['output_throughput']:.1f} | {ratio:.2f} | "
            f"{ours['mean_ttft_ms']:.0f} / {theirs['mean_ttft_ms']:.0f} | "
            f"{ours['mean_tpot_ms']:.1f} / {theirs['mean_tpot_ms']:.1f} |"
        )
    if agentic_lines:
        lines += ["", "Agentic sweep (`tokenspeed bench serve --workload agentic`):", "",
                  "| label | C | total TPM | cache hit |", "|---|---|---|---|", *agentic_lines]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
