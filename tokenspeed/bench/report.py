"""Terminal output of a sweep: live progress while it runs, a summary table at the end.

Kept apart from the runner so the sweep stays testable without a terminal
and `bench plot` can print the same table for old results.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokenspeed.bench.pareto import TPS_FLOOR

# (header, row key, format)
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("C", "concurrency", "{:d}"),
    ("req", "requests", "{:d}"),
    ("err", "errors", "{:d}"),
    ("TPS/user", "tps_per_user", "{:.1f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TPM/GPU", "total_tpm_per_gpu", "{:,.0f}"),
    ("out TPM/GPU", "output_tpm_per_gpu", "{:,.0f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("cache hit", "cache_hit_rate", "{:.1%}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}"),
    ("ITL p99", "itl_p99_ms", "{:.1f}"),
    ("E2E p50", "e2e_p50_ms", "{:.0f}"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def summary_table(rows: Sequence[dict[str, Any]], title: str = "bench serve") -> Table:
    """One line per (label, concurrency); TPS/user below the floor is shown red."""
    table = Table(title=f"{title}  (latencies in ms)", header_style="bold")
    table.add_column("label")
    for header, _, _ in _COLUMNS:
        table.add_column(header, justify="right")
    for row in rows:
        cells = [str(row.get("label", ""))]
        for _, key, fmt in _COLUMNS:
            text = _cell(row.get(key), fmt)
            tps = row.get("tps_per_user")
            if key == "tps_per_user" and isinstance(tps, float) and tps < TPS_FLOOR:
                text = f"[red]{text}[/red]"
            cells.append(text)
        table.add_row(*cells)
    return table


def print_summary(rows: Sequence[dict[str, Any]], console: Console | None = None, title: str = "bench serve") -> None:
    """Print the table; off a terminal (logs, CI) wide enough that no column is squeezed."""
    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=220)
    console.print(summary_table(rows, title))


def make_progress(enabled: bool) -> Progress:
    """A progress display on stderr (stdout stays clean for the table); silent when disabled."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
