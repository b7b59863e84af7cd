"""The chart we are judged on: TPM/GPU against TPS/user, one curve per label.

Raising concurrency trades per-user speed (x) for fleet throughput (y); the
curve of a better server lies up and to the right.  The frontier marks the
points no other point of the same label beats on both axes, and the vertical
line is the interactivity floor (70 TPS/user): the figure of merit is the
highest frontier point right of it.  Two panels: total tokens (prompt +
output, what a provider bills for agentic traffic) and output tokens only
(what decode speed decides).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

TPS_FLOOR = 70.0
PANELS = (("total_tpm_per_gpu", "total tokens / min / GPU"), ("output_tpm_per_gpu", "output tokens / min / GPU"))


def frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point dominates (>= on both axes, > on one)."""
    keep = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            keep.append(i)
    return keep


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and math.isfinite(value)


def series_by_label(rows: Sequence[dict[str, Any]], y_key: str) -> dict[str, list[tuple[float, float, int]]]:
    """label -> [(tps_per_user, y, concurrency)] sorted by concurrency, unplottable points dropped."""
    series: dict[str, list[tuple[float, float, int]]] = {}
    for row in rows:
        x, y = row.get("tps_per_user"), row.get(y_key)
        if _finite(x) and _finite(y):
            series.setdefault(str(row["label"]), []).append((float(x), float(y), int(row["concurrency"])))
    for points in series.values():
        points.sort(key=lambda p: p[2])
    return series


def _wide(values: Sequence[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) > 50


def plot_pareto(rows: Sequence[dict[str, Any]], path: Path, title: str | None = None, floor: float = TPS_FLOOR) -> Path:
    """Write the two-panel Pareto chart of `rows` to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(13, 5.5))
    for axis, (y_key, y_label) in zip(axes, PANELS):
        all_x: list[float] = []
        all_y: list[float] = []
        for label, points in sorted(series_by_label(rows, y_key).items()):
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            all_x += xs
            all_y += ys
            (line,) = axis.plot(xs, ys, marker="o", markersize=4, label=label)
            best = frontier([(x, y) for x, y in zip(xs, ys)])
            axis.scatter([xs[i] for i in best], [ys[i] for i in best], s=90, facecolors="none",
                         edgecolors=line.get_color(), linewidths=1.5)
            for x, y, concurrency in points:
                axis.annotate(f"C{concurrency}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        axis.axvline(floor, color="red", linestyle="--", linewidth=1, label=f"{floor:g} TPS/user floor")
        if _wide(all_x + [floor]):
            axis.set_xscale("log")
        if _wide(all_y):
            axis.set_yscale("log")
        axis.set_xlabel("tokens / s / user  (1000 / mean TPOT ms)")
        axis.set_ylabel(y_label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title or "Pareto: throughput per GPU vs. speed per user (circled: frontier)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
