"""Launch shapes of the one-token FP8 GEMV measured on a given GPU model, by fused form.

Why a table per GPU: the kernel is fastest at different shapes on different
cards (`benchmarks/gemv_stack.py` with 128 x 128 blocks on an H200 put qkv's
best at 16 rows x 1024, 11% under the H100's 8 x 2048 there), and the shapes
must be timed the way a decode step runs them (32 layers' weights in one CUDA
graph, PDL on), which no launch tuner at first use can do (`fp8_gemv_triton.py`).
So `gemv_stack.py --write-shapes FILE` writes the best shape of each form
into a JSON table, a table that measured faster end to end than the rules
ships beside this module for its GPU model (`fp8_gemv_shapes/<gpu>.json`;
none yet: on an H100 the sweep's best shapes are the rules themselves,
`benchmarks/results/h100/wave2/gemv_shapes_2026-12-07/`), and `choose_config`
takes a table's shape where it has one, its built-in rules elsewhere.

`TOKENSPEED_FP8_GEMV_SHAPES=FILE` reads that file instead of the shipped
table (a GPU model we ship none for, or a new sweep to compare end to end);
`TOKENSPEED_FP8_GEMV_SHAPES=none` uses the built-in rules alone.

A form is the fused decode form and the row length: `norm` (RMSNorm prologue:
qkv), `silu_mul` (gate/up), `residual` (o, down), `plain`; and whether the
weight scales are per channel (`rows`) or in blocks (`blocks`), e.g.
`norm/4096/rows`.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

SHAPES_ENV = "TOKENSPEED_FP8_GEMV_SHAPES"
SHIPPED_DIR = Path(__file__).with_name("fp8_gemv_shapes")
CONFIG_FIELDS = ("block_n", "groups", "num_warps", "stages", "f16_math")


def form_key(k: int, *, norm: bool, residual: bool, silu_mul: bool, whole_rows: bool) -> str:
    """The table key of a launch: fused form / K / scale kind (module docstring)."""
    form = "silu_mul" if silu_mul else "norm" if norm else "residual" if residual else "plain"
    return f"{form}/{k}/{'rows' if whole_rows else 'blocks'}"


def gpu_file_name(gpu_name: str) -> str:
    """`NVIDIA H200` -> `nvidia_h200.json`: the shipped table's file for a GPU model."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json"


def read_table(path: Path) -> dict[str, dict[str, Any]]:
    """A table file's shapes: {form key: {field: value}}; ValueError names the file and what is wrong."""
    try:
        shapes = json.loads(path.read_text())["shapes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{SHAPES_ENV} / shapes table {path}: cannot read its 'shapes' ({exc})") from exc
    for key, fields in shapes.items():
        if not isinstance(fields, dict) or set(fields) != set(CONFIG_FIELDS):
            raise ValueError(f"shapes table {path}: {key!r} must have exactly the fields {CONFIG_FIELDS}")
    return shapes


def write_table(path: Path, gpu_name: str, command: str, shapes: dict[str, dict[str, Any]]) -> None:
    """Merge `shapes` into the table at `path` (a sweep of per-channel scales keeps a block sweep's entries)."""
    table = {"gpu": gpu_name, "command": command, "shapes": {}}
    if path.exists():
        table["shapes"] = read_table(path)
        table["command"] = json.loads(path.read_text()).get("command", "") + " ; " + command
    table["shapes"].update(shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def table_path(gpu_name: str) -> Path | None:
    """The table for a GPU model: the env's file, else the one shipped for that model, else None (the rules)."""
    override = os.environ.get(SHAPES_ENV, "")
    if override:
        return None if override.lower() == "none" else Path(override)
    shipped = SHIPPED_DIR / gpu_file_name(gpu_name)
    return shipped if shipped.exists() else None


@cache
def table_for(gpu_name: str) -> dict[str, dict[str, Any]]:
    """The measured shapes for a GPU model (`table_path`), {} where there is no table."""
    path = table_path(gpu_name)
    return {} if path is None else read_table(path)
