"""Decode GEMVs the way a decode step runs them: one CUDA graph, a layer's weights after another.

    python benchmarks/gemv_stack.py --out benchmarks/results/h200/fp8/gemv_stack.json
    python benchmarks/gemv_stack.py --smoke --out /tmp/gemv_stack_smoke.json   # CPU: interpreter, tiny shapes

Why: a kernel timed alone (`fp8_kernels.py`, the launch tuner) pays its launch
and ramp-up in full, and an L2 flush between runs leaves the cache full of
dirty lines whose write-back shares the DRAM with the weights being read.
In a decode step neither happens: launches come from a graph, PDL overlaps
each kernel's start with the previous kernel's end, and each layer reads
weights no earlier kernel left in L2. This script measures exactly that: for
each of Llama-3.1-8B's one-token projections in its fused decode form (qkv
with the RMSNorm prologue, o with the residual, gate/up with RMSNorm and
SiLU-and-mul, down with the residual), LAYERS distinct weights (more bytes
than the L2) are launched back to back in one graph; time per launch =
replay time / LAYERS (median of `moe_kernels.graph_ms`).

Metrics (JSON `metrics`, also printed as a markdown table):
- `copy_bandwidth_gb_s`: as `gpu_suite.py` measures it (every fraction divides by it);
- `forms[form]`: weight bytes per launch, the fp8 GEMV at every shape of
  `launch_shapes` (`fp8_us[config]`) and at the one the kernel chooses
  (`fp8_chosen_us`, `fp8_chosen_config`), the bf16 Triton GEMV the bf16
  decode step runs (`bf16_us`), each with its fraction of the copy bandwidth
  (weight bytes only), and `best_fp8_config`;
- `layer`: the four forms of a layer in order, LAYERS layers in one graph, fp8
  (chosen shapes) and bf16: the GEMV share of a decode step, us per layer and fraction.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from fp8_kernels import Timer, save  # benchmarks/ is on sys.path when run as a script
from gpu_suite import log

# form -> (weight rows, K): gate_up's rows are gate then up (2 x 14336)
FORMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_FORMS = {"qkv": (96, 128), "o": (64, 128), "gate_up": (256, 128), "down": (64, 256)}
BLOCK = (128, 128)


def timed_us(fn: Callable[[], Any], smoke: bool) -> float:
    """Median us of a CUDA-graph replay of `fn` (wall clock under the CPU interpreter: the script runs)."""
    return Timer("cpu" if smoke else "cuda").us(fn)


def fused_args(form: str, k: int, n_out: int, dtype: torch.dtype, dev: str) -> dict[str, Any]:
    """The decode layer's fused form of a projection: its prologue/epilogue arguments."""
    if form in ("qkv", "gate_up"):
        return {"norm_weight": torch.ones(k, dtype=dtype, device=dev), "eps": 1e-5}
    return {"residual": torch.randn(1, n_out, device=dev).to(dtype)}


class Layers:
    """LAYERS distinct weights of one form, fp8 (scales per `block`: 128 x 128 or per channel) and bf16, and their
    launch closures."""

    def __init__(self, form: str, rows: int, k: int, layers: int, dtype: torch.dtype, dev: str,
                 block: tuple[int, int] = BLOCK) -> None:
        from tokenspeed.kernels.quant.fp8 import quantize_weight_block

        self.form, self.rows, self.k, self.block = form, rows, k, block
        self.silu_mul = form == "gate_up"
        n_out = rows // 2 if self.silu_mul else rows
        gen = torch.Generator(device=dev).manual_seed(rows + k)
        self.x = torch.randn(1, k, generator=gen, device=dev).to(dtype)
        self.fused = fused_args(form, k, n_out, dtype, dev)
        self.fp8, self.bf16 = [], []
        for _ in range(layers):
            w = torch.randn(rows, k, generator=gen, device=dev) * k**-0.5
            self.fp8.append(quantize_weight_block(w, block))
            self.bf16.append(w.to(dtype))
            del w
        self.fp8_bytes = rows * k + self.fp8[0][1].numel() * 4
        self.bf16_bytes = rows * k * 2

    def shapes_key(self) -> str:
        """This form's key in a launch-shapes table (`kernels/gemm/fp8_gemv_shapes.py`)."""
        from tokenspeed.kernels.gemm.fp8_gemv_shapes import form_key
        from tokenspeed.kernels.quant.fp8 import scales_whole_rows

        return form_key(self.k, norm="norm_weight" in self.fused, residual="residual" in self.fused,
                        silu_mul=self.silu_mul, whole_rows=scales_whole_rows(self.block, self.k))

    def fp8_one(self, layer: int, config: Any = None) -> None:
        from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton

        w8, scale = self.fp8[layer]
        fp8_gemv_triton(self.x, w8, scale, block_size=self.block, config=config, silu_mul=self.silu_mul, **self.fused)

    def bf16_one(self, layer: int) -> None:
        from tokenspeed.kernels.gemm.gemv_triton import gemv_silu_mul_triton, gemv_triton

        (gemv_silu_mul_triton if self.silu_mul else gemv_triton)(self.x, self.bf16[layer], **self.fused)

    def fp8_launch(self, config: Any = None) -> Callable[[], None]:
        return lambda: [self.fp8_one(i, config) for i in range(len(self.fp8))]

    def bf16_launch(self) -> Callable[[], None]:
        return lambda: [self.bf16_one(i) for i in range(len(self.bf16))]


def bench_form(stack: Layers, copy_gb_s: float, smoke: bool, sweep: bool = True) -> dict[str, Any]:
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_name_of
    from tokenspeed.kernels.gemm.fp8_gemv_triton import choose_config, launch_shapes

    layers = len(stack.fp8)

    def fraction(nbytes: int, us: float) -> float:
        return round(nbytes / us / 1e3 / copy_gb_s, 3)

    row: dict[str, Any] = {"fp8_weight_bytes": stack.fp8_bytes, "bf16_weight_bytes": stack.bf16_bytes}
    chosen_us = timed_us(stack.fp8_launch(), smoke) / layers  # config None: the kernel's own choice
    chosen = choose_config(stack.k, silu_mul=stack.silu_mul, block_size=stack.block, norm="norm_weight" in stack.fused,
                           residual="residual" in stack.fused, gpu_name=gpu_name_of(torch.device(stack.x.device)))
    row |= {"fp8_chosen_us": round(chosen_us, 2), "fp8_chosen_fraction": fraction(stack.fp8_bytes, chosen_us),
            "fp8_chosen_config": repr(chosen), "shapes_key": stack.shapes_key()}  # fmt: skip
    per_config: dict[str, float] = {}
    for config in launch_shapes(stack.k) if sweep else []:
        try:
            per_config[repr(config)] = round(timed_us(stack.fp8_launch(config), smoke) / layers, 2)
        except (ValueError, RuntimeError) as exc:  # a failed build: the others still run
            log(f"{stack.form} {config}: {type(exc).__name__}: {str(exc)[:160]}")
    row["fp8_us"] = per_config
    if per_config:
        best = min(per_config, key=per_config.__getitem__)
        row["best_fp8_fields"] = next(asdict(c) for c in launch_shapes(stack.k) if repr(c) == best)
        row |= {"best_fp8_config": best, "best_fp8_us": per_config[best],
                "best_fp8_fraction": fraction(stack.fp8_bytes, per_config[best])}  # fmt: skip
    bf16_us = timed_us(stack.bf16_launch(), smoke) / layers
    row |= {"bf16_us": round(bf16_us, 2), "bf16_fraction": fraction(stack.bf16_bytes, bf16_us)}
    log(f"{stack.form}: {row}")
    return row


def bench_layer(stacks: list[Layers], copy_gb_s: float, smoke: bool) -> dict[str, Any]:
    """The four forms of a layer in order, layer after layer, in one graph: fp8 (chosen shapes) and bf16."""
    layers = len(stacks[0].fp8)
    out: dict[str, Any] = {}
    for kind, nbytes in (("fp8", sum(s.fp8_bytes for s in stacks)), ("bf16", sum(s.bf16_bytes for s in stacks))):

        def step(kind: str = kind) -> None:
            for i in range(layers):
                for s in stacks:
                    getattr(s, f"{kind}_one")(i)

        us = timed_us(step, smoke) / layers
        out[kind] = {"us_per_layer": round(us, 2), "fraction": round(nbytes / us / 1e3 / copy_gb_s, 3)}
    out["bf16_over_fp8"] = round(out["bf16"]["us_per_layer"] / out["fp8"]["us_per_layer"], 3)
    log(f"layer: {out}")
    return out


def copy_bandwidth(smoke: bool) -> float:
    if smoke:
        a = torch.randn(1 << 20)
        b = torch.empty_like(a)
        return round(2 * a.numel() * 4 / timed_us(lambda: b.copy_(a), smoke) / 1e3, 1)
    from gpu_suite import copy_bandwidth_gb_s  # benchmarks/ is on sys.path when run as a script

    return copy_bandwidth_gb_s()


def markdown(metrics: dict[str, Any]) -> str:
    lines = [f"copy {metrics['copy_bandwidth_gb_s']} GB/s; {metrics['layers']} layers a graph; fp8 weight scales: "
             f"{metrics.get('weight_scales', 'blocks')}; us per launch "
             "(fraction of the copy bandwidth, weight bytes)", "",
             "| form | fp8 chosen | fp8 best | best config | bf16 | bf16 / fp8 best |", "|---|---:|---:|---|---:|---:|"]
    for form, r in metrics["forms"].items():
        lines.append(f"| {form} | {r['fp8_chosen_us']} ({r['fp8_chosen_fraction']}) | {r.get('best_fp8_us')} "
                     f"({r.get('best_fp8_fraction')}) | {r.get('best_fp8_config')} | {r['bf16_us']} "
                     f"({r['bf16_fraction']}) | {round(r['bf16_us'] / r['best_fp8_us'], 2) if r.get('best_fp8_us') else '-'} |")
    layer = metrics.get("layer")
    if layer:
        lines += ["", f"whole layer (4 forms): fp8 {layer['fp8']['us_per_layer']} us ({layer['fp8']['fraction']}), "
                  f"bf16 {layer['bf16']['us_per_layer']} us ({layer['bf16']['fraction']}), "
                  f"bf16 / fp8 {layer['bf16_over_fp8']}"]
    return "\n".join(lines)


def stack_setup(parser: argparse.ArgumentParser, args: argparse.Namespace, script: str) -> StackRun:
    """What a stack benchmark needs before its first graph (the interpreter's switch comes first)."""
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    import tokenspeed.kernels.triton_launch  # noqa: F401  (patches the interpreter when it is on)
    from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK

    dev, dtype = ("cpu", torch.float16) if args.smoke else ("cuda", torch.bfloat16)
    layers = 2 if args.smoke else args.layers
    per_channel = getattr(args, "per_channel", False)  # `add_stack_args`' option (the MoE stack has none)
    block = PER_CHANNEL_BLOCK if per_channel else BLOCK
    return StackRun(
        dev=dev, dtype=dtype, layers=layers, shapes=SMOKE_FORMS if args.smoke else FORMS, block=block,
        command=" ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter, smoke)",
        metrics={"copy_bandwidth_gb_s": copy_bandwidth(args.smoke), "layers": layers, "forms": {},
                 "weight_scales": "per channel" if per_channel else f"{BLOCK[0]} x {BLOCK[1]} blocks"},
    )  # fmt: skip


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    """The options both stack benchmarks take."""
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--skip-shapes", action="store_true", help="only the chosen shapes, not every launch shape")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (tests the script)")
    parser.add_argument("--per-channel", action="store_true",
                        help="fp8 weights with one scale per row (online `quantization=\"fp8\"`), not 128 x 128 blocks")
    parser.add_argument("--write-shapes", type=Path, default=None, metavar="FILE",
                        help="merge the best launch shapes into this table (`kernels/gemm/fp8_gemv_shapes.py`; "
                             "`TOKENSPEED_FP8_GEMV_SHAPES=FILE` runs the engine with it)")


@dataclass
class StackRun:
    dev: str
    dtype: torch.dtype
    layers: int
    shapes: dict[str, tuple[int, int]]
    block: tuple[int, int]  # the fp8 weights' scale block
    command: str
    device: str
    metrics: dict[str, Any]

    def finish(self, out: Path, table: str) -> None:
        """The JSON, and the markdown table beside it."""
        date = save(out, self.command, self.device, self.metrics)
        out.with_suffix(".md").write_text(f"`{self.command}` on {self.device}, {date}\n\n{table}\n")
        print(table)

    def write_shapes(self, path: Path | None, best: dict[str, dict[str, Any]]) -> None:
        """`--write-shapes`: merge `best` ({table key: launch shape fields}) into the table at `path`."""
        if path is not None:
            from tokenspeed.kernels.gemm.fp8_gemv_shapes import write_table

            write_table(path, self.device, self.command, best)
            log(f"{len(best)} best shapes written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/fp8/gemv_stack.json"))
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated subset of " + ",".join(FORMS))
    add_stack_args(parser)
    args = parser.parse_args()
    run = stack_setup(parser, args, "gemv_stack.py")
    metrics = run.metrics
    stacks = []
    for form in args.forms.split(","):
        stack = Layers(form, *run.shapes[form], run.layers, run.dtype, run.dev, run.block)
        metrics["forms"][form] = bench_form(stack, metrics["copy_bandwidth_gb_s"], args.smoke, not args.skip_shapes)
        stacks.append(stack)
        save(args.out, run.command, run.device, metrics)  # rewritten after each form: a timeout keeps what finished
    if len(stacks) == len(FORMS):
        metrics["layer"] = bench_layer(stacks, metrics["copy_bandwidth_gb_s"], args.smoke)
    run.finish(args.out, markdown(metrics))
    run.write_shapes(args.write_shapes, {r["shapes_key"]: r["best_fp8_fields"] for r in metrics["forms"].values()
                                         if "best_fp8_fields" in r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
