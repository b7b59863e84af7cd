"""FP8 projections at 2-16 tokens the way a decode step runs them: one CUDA graph, a layer's weights after another.

    python benchmarks/fp8_skinny_stack.py --out benchmarks/results/h200/fp8/skinny_stack.json
    python benchmarks/fp8_skinny_stack.py --smoke --out /tmp/skinny_smoke.json   # CPU: interpreter, tiny shapes

For each of Llama-3.1-8B's projections (plain: no fused norm or residual,
as a decode step of several rows runs them) and each token count, LAYERS
distinct weights are launched back to back in one graph (as
`gemv_stack.py` does for one token) and the time per launch is the replay
time / LAYERS, for:
- `skinny[config]`: the tensor-core skinny GEMM (`fp8_skinny_triton.py`) at
  every launch shape of `skinny_shapes`, and `skinny_chosen` at the shape
  `gemm.fp8` runs at these sizes: a shapes table's (`skinny_chosen_from`:
  its file) or the launch tuner's pick (`skinny_tuner_us`: the tuner's own
  times, each launch alone);
- `gemm`: the FP8 GEMM that served these sizes before (`gemm.fp8` above the
  GEMV's range: cuBLAS block-scaled or rowwise `scaled_mm`, with its
  activation quantisation kernel);
- `bf16`: `F.linear` on the bf16 weights (cuBLAS).
Each with its fraction of the copy bandwidth (weight bytes only).

`--write-shapes FILE` merges each weight shape's best launch shape (least
time summed over the token counts run) into a launch-shapes table
(`kernels/gemm/fp8_gemv_shapes.py`; `TOKENSPEED_FP8_GEMV_SHAPES=FILE` runs
the engine with it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fp8_kernels import save  # benchmarks/ is on sys.path when run as a script
from gemv_stack import Layers, add_stack_args, stack_setup, timed_us
from gpu_suite import log


def bench(stack: Layers, tokens: int, copy_gb_s: float, smoke: bool, sweep: bool = True) -> dict[str, Any]:
    from tokenspeed.kernels.gemm.fp8_dispatch import select_fp8_gemm_by_batch
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_name_of, table_path
    from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton
    from tokenspeed.kernels.gemm.fp8_skinny_triton import (
        measured_skinny_shape,
        skinny_shapes,
        tuned_skinny_shapes,
    )

    layers = len(stack.fp8)
    x = torch.randn(tokens, stack.k, device=stack.x.device).to(stack.x.dtype)
    gemm = select_fp8_gemm_by_batch(platform="cuda", dtype=x.dtype).large.impl

    def each(one: Callable[[int], object]) -> Callable[[], None]:
        return lambda: [one(i) for i in range(layers)]

    def us(fn: Callable[[], None]) -> float:
        return round(timed_us(fn, smoke) / layers, 2)

    def fraction(nbytes: int, t: float) -> float:
        return round(nbytes / t / 1e3 / copy_gb_s, 3)

    row: dict[str, Any] = {"skinny": {}}
    for config in skinny_shapes() if sweep else []:
        try:
            row["skinny"][repr(config)] = us(each(lambda i, c=config: fp8_gemv_triton(
                x, *stack.fp8[i], block_size=stack.block, config=c)))  # fmt: skip
        except (ValueError, RuntimeError) as exc:  # a failed build: the others still run
            log(f"{stack.form} x{tokens} {config}: {type(exc).__name__}: {str(exc)[:160]}")
    fp8_gemv_triton(x, *stack.fp8[0], block_size=stack.block)  # eager: the table's shape, or the tuner picks one
    chosen = us(each(lambda i: fp8_gemv_triton(x, *stack.fp8[i], block_size=stack.block)))
    gpu = gpu_name_of(x.device)
    measured = measured_skinny_shape(stack.rows, stack.k, stack.block, gpu)
    picks = [c for key, c in tuned_skinny_shapes().items() if key[:2] == (stack.rows, stack.k)]
    row |= {"skinny_chosen_us": chosen, "skinny_chosen_fraction": fraction(stack.fp8_bytes, chosen),
            "skinny_chosen_config": repr(measured or (picks[0].config if picks else None)),
            "skinny_chosen_from": str(table_path(gpu)) if measured else "launch tuner",
            "skinny_tuner_us": picks[0].timings_us if picks and not measured else None}  # fmt: skip
    if row["skinny"]:
        best = min(row["skinny"], key=row["skinny"].__getitem__)
        row |= {"skinny_best": best, "skinny_best_us": row["skinny"][best]}
    gemm_us = us(each(lambda i: gemm(x, *stack.fp8[i], block_size=stack.block)))
    bf16_us = us(each(lambda i: F.linear(x, stack.bf16[i])))
    row |= {"gemm_us": gemm_us, "gemm_fraction": fraction(stack.fp8_bytes, gemm_us),
            "bf16_us": bf16_us, "bf16_fraction": fraction(stack.bf16_bytes, bf16_us),
            "gemm_over_skinny": round(gemm_us / chosen, 3)}  # fmt: skip
    log(f"{stack.form} x{tokens}: {row}")
    return row


def markdown(metrics: dict[str, Any]) -> str:
    lines = [f"copy {metrics['copy_bandwidth_gb_s']} GB/s; {metrics['layers']} layers a graph; fp8 weight scales: "
             f"{metrics.get('weight_scales', 'blocks')}; us per launch "
             "(fraction of the copy bandwidth, weight bytes)", "",
             "| form | tokens | skinny chosen | best shape | best us | FP8 GEMM before | bf16 cuBLAS | before / skinny |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for form, by_tokens in metrics["forms"].items():
        for tokens, r in by_tokens.items():
            lines.append(f"| {form} | {tokens} | {r['skinny_chosen_us']} ({r['skinny_chosen_fraction']}) | "
                         f"{r.get('skinny_best')} | {r.get('skinny_best_us')} | {r['gemm_us']} ({r['gemm_fraction']}) | "
                         f"{r['bf16_us']} ({r['bf16_fraction']}) | {r['gemm_over_skinny']} |")
    return "\n".join(lines)


def best_shapes(weights: dict[str, tuple[int, int, tuple[int, int]]], metrics: dict[str, Any]) -> dict[str, Any]:
    """{table key: fields} of each form's weight shape (rows, K, scale block): its launch shape with the least
    time summed over the token counts (`--write-shapes`), among the shapes every token count ran."""
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import skinny_key
    from tokenspeed.kernels.gemm.fp8_skinny_triton import skinny_shapes
    from tokenspeed.kernels.quant.fp8 import scales_whole_rows

    best = {}
    for form, (n, k, block) in weights.items():
        rows = metrics["forms"][form].values()
        ran = [c for c in skinny_shapes() if all(repr(c) in r["skinny"] for r in rows)]
        if ran:
            config = min(ran, key=lambda c: sum(r["skinny"][repr(c)] for r in rows))
            best[skinny_key(n, k, whole_rows=scales_whole_rows(block, k))] = asdict(config)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/fp8/skinny_stack.json"))
    parser.add_argument("--tokens", default="2,4,8,16", help="comma-separated token counts (2-16)")
    add_stack_args(parser)
    args = parser.parse_args()
    run = stack_setup(parser, args, "fp8_skinny_stack.py")
    metrics = run.metrics
    for form, (rows, k) in run.shapes.items():
        stack = Layers(form, rows, k, run.layers, run.dtype, run.dev, run.block)
        metrics["forms"][form] = {t: bench(stack, int(t), metrics["copy_bandwidth_gb_s"], args.smoke, not args.skip_shapes)
                                  for t in args.tokens.split(",")}
        del stack
        save(args.out, run.command, run.device, metrics)  # rewritten after each form: a timeout keeps what finished
    run.finish(args.out, markdown(metrics))
    run.write_shapes(args.write_shapes, best_shapes({f: (n, k, run.block) for f, (n, k) in run.shapes.items()}, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
