"""Launch shapes of the FP8 decode GEMMs measured on a given GPU model: the one-token GEMV by fused form, the
skinny GEMM (2-16 tokens) by weight shape.

Why a table per GPU: the kernels are fastest at different shapes on different
cards (`benchmarks/gemv_stack.py` with 128 x 128 blocks on an H200 put qkv's
best at 16 rows x 1024, 11% under the H100's 8 x 2048 there), and the shapes
must be timed the way a decode step runs them (32 layers' weights in one CUDA
graph, PDL on), which no launch tuner at first use can do: timed alone, a
launch pays the ramp-up and the L2 flush that no decode step pays. The skinny
GEMM's tuner (`fp8_skinny_triton.py`) does time its four K splits that way,
and its pick moved between runs of one tree (down: 4 or 8 splits, o: 2 or 8) and
missed the graph's best by up to 10% (qkv at 4 tokens on an H100,
`benchmarks/results/h100/wave2/fp8_2026-12-06f/call3/skinny_stack.json`).
So `gemv_stack.py --write-shapes FILE` writes the best shape of each fused
form and `fp8_skinny_stack.py --write-shapes FILE` the best of each weight
shape (least time summed over the token counts it ran) into a JSON table; a
table that measured faster end to end than the rules ships beside this
module for its GPU model (`fp8_gemv_shapes/<gpu>.json`). The H100 SXM's
holds the skinny GEMM's four Llama-3.1-8B weight shapes (per-channel
scales) from a sweep with the two-warp shapes: Llama-3.1-8B FP8 decoded
0.9% / 1.4% faster at 2 / 16 rows than with o_proj's entry alone, in every
pair (`benchmarks/results/h100/wave2/skinny_table_2026-12-07/`). o_proj's
8 K splits were measured first: the tuner took 2, 4 or 8 there from run to
run (timed alone they are within a few percent), and Llama-3.1-8B FP8
decoded 4-5% slower at 2-16 rows with 2 than with 8
(`satfinite_2026-12-07/` there). The one-token GEMV's H100 sweep was no
faster end to end than its rules (`gemv_shapes_2026-12-07/`). The H200's holds
the one-token GEMV's sweeps (per-channel and block scales): gate/up at 32
rows x 256 in the fp32 loop (the other forms' bests are the rules'), and
Llama-3.1-8B FP8 bs1 decoded 3.6% faster with it than with the rules, in
three alternating pairs; its skinny sweep was 0.4-0.9% slower end to end
and is left out (`benchmarks/results/h200/fp8/2026-12-07/`).
Where a table has a key, its shape runs; elsewhere the one-token GEMV's built-in rules
(`choose_config`) and the skinny GEMM's tuner.

`TOKENSPEED_FP8_GEMV_SHAPES=FILE` reads that file instead of the shipped
table (a GPU model we ship none for, or a new sweep to compare end to end);
`TOKENSPEED_FP8_GEMV_SHAPES=none` uses the built-in rules and tuner alone.

Keys: the one-token GEMV's fused decode form and row length, `norm` (RMSNorm
prologue: qkv), `silu_mul` (gate/up), `residual` (o, down), `plain`, e.g.
`norm/4096/rows`; the skinny GEMM's weight shape, e.g. `skinny/6144x4096/rows`;
each ending in whether the weight scales are per channel (`rows`) or in
blocks (`blocks`).
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import torch

SHAPES_ENV = "TOKENSPEED_FP8_GEMV_SHAPES"
SHIPPED_DIR = Path(__file__).with_name("fp8_gemv_shapes")
CONFIG_FIELDS = ("block_n", "groups", "num_warps", "stages", "f16_math", "tma")  # `Fp8GemvConfig`'s
SKINNY_FIELDS = ("block_n", "groups", "stages", "num_warps", "split_k", "tma")  # `SkinnyConfig`'s
_SKINNY = "skinny/"


def form_key(k: int, *, norm: bool, residual: bool, silu_mul: bool, whole_rows: bool) -> str:
    """The table key of a launch: fused form / K / scale kind (module docstring)."""
    form = "silu_mul" if silu_mul else "norm" if norm else "residual" if residual else "plain"
    return f"{form}/{k}/{_scale_kind(whole_rows)}"


def skinny_key(n: int, k: int, *, whole_rows: bool) -> str:
    """The table key of a skinny GEMM launch: its weight's rows x K / scale kind (module docstring)."""
    return f"{_SKINNY}{n}x{k}/{_scale_kind(whole_rows)}"


def _scale_kind(whole_rows: bool) -> str:
    return "rows" if whole_rows else "blocks"


def _fields_of(key: str) -> tuple[str, ...]:
    return SKINNY_FIELDS if key.startswith(_SKINNY) else CONFIG_FIELDS


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
        if not isinstance(fields, dict) or set(fields) != set(_fields_of(key)):
            raise ValueError(f"shapes table {path}: {key!r} must have exactly the fields {_fields_of(key)}")
    return shapes


def write_table(path: Path, gpu_name: str, command: str, shapes: dict[str, dict[str, Any]]) -> None:
    """Merge `shapes` into the table at `path` (a sweep of per-channel scales keeps a block sweep's entries,
    the skinny sweep the one-token sweep's)."""
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


def gpu_name_of(device: torch.device) -> str:
    """The GPU model's name (`table_for`'s key); "" off CUDA."""
    return _cuda_name(device.index or 0) if device.type == "cuda" else ""


@cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
