"""`tokenspeed bench plot DIR1 DIR2 ...`: overlay earlier runs on one Pareto chart.

Each folder's rows keep their labels; when two folders use the same label
(e.g. today's and last week's `tokenspeed`), the folder name is prefixed so
the curves stay apart.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from tokenspeed.bench.pareto import TPS_FLOOR, plot_pareto
from tokenspeed.bench.report import print_summary
from tokenspeed.bench.results_io import read_rows


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("plot", help="overlay results folders of `bench serve` on one Pareto chart")
    parser.add_argument("dirs", nargs="+", type=Path, help="folders holding results.json")
    parser.add_argument("--output", type=Path, default=Path("pareto.png"), help="chart file (default: %(default)s)")
    parser.add_argument("--title", default=None, help="chart title (default: none)")
    parser.add_argument("--floor", type=float, default=TPS_FLOOR, help="TPS/user floor to draw (default: %(default)s)")
    parser.set_defaults(handler=run)


def combine(dirs: list[Path]) -> list[dict[str, Any]]:
    """Rows of every folder; a label found in several folders becomes `folder/label`."""
    per_dir = [(d, read_rows(d)) for d in dirs]
    owners = Counter(label for _, rows in per_dir for label in {str(r["label"]) for r in rows})
    combined = []
    for folder, rows in per_dir:
        for row in rows:
            label = str(row["label"])
            combined.append({**row, "label": f"{folder.name}/{label}" if owners[label] > 1 else label})
    return combined


def run(args: argparse.Namespace) -> int:
    missing = [str(d) for d in args.dirs if not read_rows(d)]
    if missing:
        print(f"error: no results.json rows in {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = combine(args.dirs)
    plot_pareto(rows, args.output, title=args.title, floor=args.floor)
    print_summary(rows, title="bench plot")
    print(f"wrote {args.output}")
    return 0
