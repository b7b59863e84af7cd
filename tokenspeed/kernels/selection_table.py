"""What the registry would pick on this machine, for every family and mode: `tokenspeed kernels`.

Kernels are chosen once per model build or step bucket, so when a run is slow
the first question is "which implementation served this op, and why not the
faster one?". This answers it without building a model: the same
`describe_selection` the layers use, for a platform/dtype and optional
traits/workload given on the command line (a kernel restricted to a workload
range is reported as rejected when that workload is not stated).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokenspeed.kernels.registry import SelectionReport, describe_selection, list_kernels, platform_of

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_platform() -> str:
    return platform_of("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(platform: str) -> torch.dtype:
    """The dtype the engine runs in on `platform` (bf16 on GPUs, fp32 on the CPU)."""
    return torch.float32 if platform == "cpu" else torch.bfloat16


def parse_assignments(items: list[str] | None, *, as_range: bool) -> dict[str, object]:
    """`key=value` pairs; values are ints, `lo-hi` ranges (workloads) or true/false/strings (traits)."""
    parsed: dict[str, object] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        if as_range:
            lo, dash, hi = value.partition("-")
            parsed[key] = (int(lo), int(hi)) if dash else int(value)
        elif value.lower() in ("true", "false"):
            parsed[key] = value.lower() == "true"
        else:
            parsed[key] = int(value) if value.lstrip("-").isdigit() else value
    return parsed


def selection_table(
    *,
    platform: str,
    dtype: torch.dtype,
    family: str | None = None,
    traits: Mapping[str, object] | None = None,
    workload: Mapping[str, object] | None = None,
) -> list[SelectionReport]:
    """One report per registered family.mode (optionally one family), in a stable order."""
    keys = sorted({(spec.family, spec.mode) for spec in list_kernels(family)})
    return [
        describe_selection(
            fam,
            mode,
            platform=platform,
            dtype=dtype,
            traits=traits,
            workload=workload,  # type: ignore[arg-type]
        )
        for fam, mode in keys
    ]
