"""results.json / results.csv / requests-LABEL.jsonl in a run's output folder.

One row per (label, concurrency point).  Running again into the same folder
with another `--label` (our server, then vLLM) *adds* that label's rows and
replaces only rows of the same label, so one folder holds the comparison and
its pareto.png shows every curve.  JSON is the source of truth (it keeps
types and nested server info); the CSV is the same rows, flattened, for
spreadsheets.  Per-request records go to JSON lines for after-the-fact
analysis (e.g. cached tokens turn over turn).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenspeed.bench.client import RequestRecord

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
SCHEMA_VERSION = 1

# Leading CSV columns, in this order; the remaining ones follow sorted.
_LEADING = (
    "label", "workload", "concurrency", "tps_per_user", "total_tpm_per_gpu", "output_tpm_per_gpu",
    "output_tokens_per_s", "request_throughput", "cache_hit_rate", "requests", "errors", "sessions",
)


def _json_safe(value: Any) -> Any:
    """NaN is not JSON; write it as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results folder (or of a results.json path); [] if none yet."""
    file = path / RESULTS_JSON if path.is_dir() else path
    if not file.exists():
        return []
    data = json.loads(file.read_text())
    return list(data.get("rows", []))


def merge_rows(existing: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Existing rows of other labels, then the new rows; sorted by label and concurrency."""
    labels = {row["label"] for row in new}
    merged = [row for row in existing if row.get("label") not in labels] + list(new)
    return sorted(merged, key=lambda row: (str(row.get("label")), int(row.get("concurrency", 0))))


def _columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    keys: set[str] = set()
    for row in rows:
        keys.update(row)
    return [k for k in _LEADING if k in keys] + sorted(keys - set(_LEADING))


def _csv_cell(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def write_rows(out_dir: Path, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge `rows` into the folder's results and rewrite results.json and results.csv."""
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = merge_rows(read_rows(out_dir), rows)
    document = {"schema_version": SCHEMA_VERSION, "rows": _json_safe(merged)}
    (out_dir / RESULTS_JSON).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    columns = _columns(merged)
    with (out_dir / RESULTS_CSV).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in merged:
            writer.writerow({key: _csv_cell(row.get(key)) for key in columns})
    return merged


def requests_path(out_dir: Path, label: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    return out_dir / f"requests-{safe}.jsonl"


def append_request(out_dir: Path, label: str, concurrency: int, record: RequestRecord) -> None:
    """One finished request, appended as it arrives, so that a run stopped early keeps what it measured
    (`write_requests` rewrites the file whole at the end)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    line = {"label": label, "concurrency": concurrency, **asdict(record)}
    with requests_path(out_dir, label).open("a") as handle:
        handle.write(json.dumps(_json_safe(line), sort_keys=True) + "\n")


def write_requests(out_dir: Path, label: str, concurrency_records: Iterable[tuple[int, Sequence[RequestRecord]]]) -> Path:
    """One JSON line per request, tagged with its concurrency point (replaces the label's file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = requests_path(out_dir, label)
    with path.open("w") as handle:
        for concurrency, records in concurrency_records:
            for record in records:
                line = {"label": label, "concurrency": concurrency, **asdict(record)}
                handle.write(json.dumps(_json_safe(line), sort_keys=True) + "\n")
    return path
