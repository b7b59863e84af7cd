"""Terminal output of a sweep: live progress while it runs, a summary table at the end.

Kept apart from the runner so the sweep stays testable without a terminal
and `bench plot` can print the same table for old results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokenspeed.bench.pareto import TPS_FLOOR

# (header, row key, format, shown in the terminal). The terminal table keeps to 100 columns;
# the full one goes to summary.txt beside results.csv/json, which hold every metric.
_COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("C", "concurrency", "{:d}", True),
    ("req", "requests", "{:d}", True),
    ("err", "errors", "{:d}", True),
    ("TPS/user", "tps_per_user", "{:.1f}", True),
    ("out tok/s", "output_tokens_per_s", "{:.1f}", False),
    ("TPM/GPU", "total_tpm_per_gpu", "{:,.0f}", True),
    ("out TPM/GPU", "output_tpm_per_gpu", "{:,.0f}", False),
    ("req/s", "request_throughput", "{:.2f}", False),
    ("cache hit", "cache_hit_rate", "{:.1%}", True),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}", True),
    ("TTFT p99", "ttft_p99_ms", "{:.0f}", True),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}", True),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}", True),
    ("ITL p99", "itl_p99_ms", "{:.1f}", True),
    ("E2E p50", "e2e_p50_ms", "{:.0f}", False),
)
TERMINAL_WIDTH = 100
_LABEL_WIDTH = 18


def _cell(value: Any, fmt: str, compact: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if compact and fmt == "{:,.0f}" and isinstance(value, int | float) and abs(value) >= 1e4:
        return _si(float(value))
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _si(value: float) -> str:
    """12,345,678 -> 12.3M: tokens per minute run to nine digits, which the terminal cannot spare."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"


def summary_table(rows: Sequence[dict[str, Any]], title: str = "bench serve", *, full: bool = True) -> Table:
    """One line per (label, concurrency); TPS/user below the floor is shown red.

    `full=False` is the terminal's table: the main columns, compact numbers, and the label in
    the title when every row has the same one.
    """
    columns = [c for c in _COLUMNS if full or c[3]]
    labels = list(dict.fromkeys(str(row.get("label", "")) for row in rows))
    label_column = full or len(labels) > 1
    if not label_column and labels and labels[0]:
        title = f"{title}: {labels[0]}"
    table = Table(title=f"{title}  (latencies in ms)", header_style="bold",
                  box=box.HEAVY_HEAD if full else box.SIMPLE_HEAD, pad_edge=full)
    if label_column:
        table.add_column("label", max_width=None if full else _LABEL_WIDTH, overflow="fold")
    for header, _, _, _ in columns:  # two-line headers in the terminal: the numbers set the width
        header = header if full else header.replace(" ", "\n").replace("/", "/\n")
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        cells = [str(row.get("label", ""))] if label_column else []
        for _, key, fmt, _ in columns:
            text = _cell(row.get(key), fmt, compact=not full)
            tps = row.get("tps_per_user")
            if key == "tps_per_user" and isinstance(tps, float) and tps < TPS_FLOOR:
                text = f"[red]{text}[/red]"
            cells.append(text)
        table.add_row(*cells)
    return table


def print_summary(rows: Sequence[dict[str, Any]], console: Console | None = None, title: str = "bench serve") -> None:
    """Print the terminal table in at most 100 columns (fewer on a narrower terminal; logs get 100)."""
    console = console or Console()
    width = min(console.width, TERMINAL_WIDTH) if console.is_terminal else TERMINAL_WIDTH
    console.print(summary_table(rows, title, full=False), width=width)


def write_summary(rows: Sequence[dict[str, Any]], path: Path, title: str = "bench serve") -> None:
    """The full table, every column, as text (the terminal shows the main ones)."""
    with path.open("w") as file:
        Console(file=file, width=240, no_color=True).print(summary_table(rows, title))


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
