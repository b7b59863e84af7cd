"""The printed form of a compiled plan and of what each rank holds (`tokenspeed placement`).

Stable text by design: golden tests compare it line for line, so a change to
the compiler's choices shows up as a readable diff. Consecutive layers whose
ops read the same (short module names) are printed once ("layers 1-26").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tokenspeed.placement.compiler import CompiledPlan, OpKind, PlanOp
from tokenspeed.placement.placements import format_layout

T = TypeVar("T")


def _op_line(op: PlanOp) -> str:
    kind = op.kind.value + (f" {op.detail}" if op.detail else "") + (f" dim={op.dim}" if op.dim is not None else "")
    module = op.module.short_name
    if op.kind is OpKind.COMPUTE:
        module += f" ({op.module.kind.value})"
    group = f"{op.group.value} x{op.group_size}" if op.group is not None else ""
    sent = f"{op.bytes_per_token:,} B/token" if op.kind.communicates else ""
    return f"  {kind:<30} {module:<34} {group:<14} {sent:>18}  -> {format_layout(op.layout)}".rstrip()


def runs(items: Sequence[T], key: Callable[[T], object]) -> list[tuple[int, int]]:
    """[first, last] index pairs of consecutive items with equal keys."""
    runs: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        if runs and key(items[runs[-1][0]]) == key(item):
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def span(word: str, first: int, last: int) -> str:
    return f"{word} {first}" if first == last else f"{word}s {first}-{last}"


def format_plan(plan: CompiledPlan) -> str:
    graph = plan.graph
    lines = [
        f"groups: {plan.topology.describe()}",
        "B/token: bytes each rank sends per token of the step (ring algorithms)",
    ]
    first_layer = next((i for i, op in enumerate(plan.ops) if op.module.layer is not None), len(plan.ops))
    lines += ["", "embedding:"] + [_op_line(op) for op in plan.ops[:first_layer] if op.module.layer is None]
    layers = [[_op_line(op) for op in plan.layer_ops(i)] for i in range(graph.num_layers)]
    for first, last in runs(layers, lambda text: text):
        lines += ["", span("layer", first, last) + ":"] + layers[first]
    lines += ["", "final:"] + [_op_line(op) for op in plan.ops[first_layer:] if op.module.layer is None]
    in_layers = sum(op.bytes_per_token for op in plan.ops if op.module.layer is not None)
    collectives = len(plan.collectives())
    lines += [
        "",
        f"collectives: {collectives}; sent per token by each rank: {plan.bytes_per_token():,} B "
        f"({in_layers:,} B in the decoder layers)",
    ]
    return "\n".join(lines)


def gib(n: int) -> str:
    return f"{n:,} B ({n / 2**30:.2f} GiB)"
