"""Fused-MoE kernels (`moe.experts`) against the dense bf16 matmul rate, on one GPU.

    python benchmarks/moe_kernels.py --out benchmarks/results/h200_moe_kernels.json

Shapes: Moonlight-16B-A3B (hidden 2048, moe_intermediate 1408, 64 experts,
top-6) and Qwen3-30B-A3B (2048, 768, 128 experts, top-8), bf16, at 16, 64,
256, 1024 and 4096 tokens with seeded uniformly random routing. Each
implementation (triton, grouped_mm) is captured in a CUDA graph and the replay
timed (`gpu_suite.bench_ms`, median), so decode sizes are not measured as host
launch overhead; the executor replays graphs the same way.

Metrics (JSON `metrics`, also printed as a markdown table):
- `fused_moe_tflops[shape][tokens][impl]`: 2*T*k*(H*2I + I*H) / time;
- `...["selected"]`: the kernel `select_experts_by_batch` picks at that size;
- `...["dense_tflops"]`: a dense [T*k, H] x [H, 2I] bf16 matmul (the same rows
  as the first grouped GEMM, without the grouping), and `ratio_selected_to_dense`;
- `fused_moe_weight_gb_s`: weight bytes of the experts hit / time (what bounds decode);
- `bf16_matmul_tflops`: an 8192^3 product, the device's practical peak
  (`ratio_selected_to_peak` divides by it);
- `route_us[shape][tokens]`: the shape's routing, Triton kernel and torch reference;
- `align_us[shape][tokens]`: the pairs' alignment by expert (16-row blocks), the one-program Triton
  kernel (up to `ALIGN_TRITON_MAX_PAIRS` pairs; null above) and the torch version;
- `grouped_mm_faster_from_tokens[shape]`: smallest measured T from which grouped_mm
  beats triton at every larger measured T, the measurement behind
  `experts_grouped_mm.GROUPED_MM_MIN_TOKENS`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_suite import bench_ms, log  # benchmarks/ is on sys.path when run as a script

from tokenspeed.kernels.moe.align import align_by_expert
from tokenspeed.kernels.moe.align_triton import ALIGN_TRITON_MAX_PAIRS, align_by_expert_triton
from tokenspeed.kernels.moe.experts_dispatch import select_experts_by_batch
from tokenspeed.kernels.moe.experts_grouped_mm import (
    GROUPED_MM_AVAILABLE,
    GROUPED_MM_MIN_TOKENS,
    fused_experts_grouped_mm,
)
from tokenspeed.kernels.moe.experts_triton import fused_experts_triton
from tokenspeed.kernels.moe.routing_reference import route_reference
from tokenspeed.kernels.moe.routing_triton import route_triton

SHAPES = {  # name: (hidden, moe_intermediate, experts, top_k)
    "moonlight": (2048, 1408, 64, 6),
    "qwen3_30b_a3b": (2048, 768, 128, 8),
}
ROUTING = {  # each shape's router, as its config asks (`route` keyword arguments)
    "moonlight": dict(
        top_k=6, scoring="sigmoid", renormalize=True, num_groups=1, topk_groups=1, group_scoring="top2_sum"
    )
    | dict(routed_scaling_factor=2.446),
    "qwen3_30b_a3b": dict(top_k=8, scoring="softmax", renormalize=True),
}
TOKENS = (16, 64, 256, 1024, 4096)
BF16 = torch.bfloat16
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def graph_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median ms of `fn` replayed from a CUDA graph (eager if capture fails), over ~`reps` x 10 ms of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        log(f"graph capture failed ({exc}); timing eagerly")
        return bench_ms(fn, reps=reps)
    return bench_ms(graph.replay, reps=reps)


def bind(fn: Experts, *args: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`fn(*args)` as a closure (a loop's variables must not leak into lambdas timed later)."""
    return lambda: fn(*args)


def matmul_peak_tflops(m: int = 8192) -> float:
    a = torch.randn(m, m, device="cuda").to(BF16)
    b = torch.randn(m, m, device="cuda").to(BF16)
    return round(2 * m**3 / bench_ms(lambda: a @ b, reps=20) / 1e9, 1)


def uniform_routing(
    tokens: int, experts: int, top_k: int, seed: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, uniformly at random; softmax weights over random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=-1).indices
    weights = torch.randn(tokens, top_k, generator=gen, device=device).softmax(dim=-1)
    return weights, ids.to(torch.int32)


def time_routing(name: str, tokens: int, experts: int, gen: torch.Generator) -> dict[str, float]:
    """Microseconds of the shape's routing (bf16 logits), Triton kernel and torch reference."""
    logits = torch.randn(tokens, experts, generator=gen, device="cuda").to(BF16)
    args: dict[str, Any] = dict(ROUTING[name])
    if args["scoring"] == "sigmoid":
        args["correction_bias"] = torch.rand(experts, generator=gen, device="cuda")
    return {
        impl: round(1000 * graph_ms(functools.partial(fn, logits, **args)), 1)
        for impl, fn in (("triton", route_triton), ("reference", route_reference))
    }


def time_alignment(ids: torch.Tensor, experts: int) -> dict[str, float | None]:
    """Microseconds of aligning the pairs by expert in 16-row blocks: Triton (where it serves) and torch."""
    fits = ids.numel() <= ALIGN_TRITON_MAX_PAIRS
    return {
        "triton": round(1000 * graph_ms(functools.partial(align_by_expert_triton, ids, experts, 16)), 1) if fits else None,
        "torch": round(1000 * graph_ms(functools.partial(align_by_expert, ids, experts, 16)), 1),
    }


def bench_shape(name: str, tokens_list: tuple[int, ...], metrics: dict[str, Any]) -> None:
    hidden, inter, experts, top_k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).to(BF16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).to(BF16)
    impls: dict[str, Experts] = {"triton": fused_experts_triton}
    if GROUPED_MM_AVAILABLE:
        impls["grouped_mm"] = fused_experts_grouped_mm
    by_batch = select_experts_by_batch(platform="cuda", dtype=BF16)
    bytes_per_expert = 3 * inter * hidden * w13.element_size()
    tflops = metrics["fused_moe_tflops"].setdefault(name, {})
    gb_s = metrics["fused_moe_weight_gb_s"].setdefault(name, {})
    route_us = metrics["route_us"].setdefault(name, {})
    align_us = metrics["align_us"].setdefault(name, {})
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(BF16)
        weights, ids = uniform_routing(tokens, experts, top_k, seed=tokens)
        flops = 2 * tokens * top_k * (hidden * 2 * inter + inter * hidden)
        weight_bytes = int(ids.unique().numel()) * bytes_per_expert
        row: dict[str, Any] = {}
        rates: dict[str, float] = {}
        for impl, fn in impls.items():
            ms = graph_ms(bind(fn, x, w13, w2, weights, ids))
            row[impl] = round(flops / ms / 1e9, 2)
            rates[impl] = round(weight_bytes / ms / 1e6, 1)
        selected = by_batch.kernel_for(tokens).name
        rows = torch.randn(tokens * top_k, hidden, generator=gen, device="cuda").to(BF16)
        dense_w = w13[0].t()
        dense_ms = graph_ms(functools.partial(torch.matmul, rows, dense_w))
        dense = 2 * tokens * top_k * hidden * 2 * inter / dense_ms / 1e9
        row["selected"] = selected
        row["dense_tflops"] = round(dense, 2)
        if selected in row:
            row["ratio_selected_to_dense"] = round(row[selected] / dense, 3)
            row["ratio_selected_to_peak"] = round(row[selected] / metrics["bf16_matmul_tflops"], 3)
        tflops[str(tokens)] = row
        gb_s[str(tokens)] = rates
        route_us[str(tokens)] = time_routing(name, tokens, experts, gen)
        align_us[str(tokens)] = time_alignment(ids, experts)
        log(f"{name} T={tokens}: {row}")
    if "grouped_mm" in impls:
        measured = sorted(int(t) for t in tflops)
        faster = [t for t in measured if tflops[str(t)]["grouped_mm"] > tflops[str(t)]["triton"]]
        crossover = next((t for t in measured if all(u in faster for u in measured if u >= t)), None)
        metrics["grouped_mm_faster_from_tokens"][name] = crossover


def markdown(metrics: dict[str, Any]) -> str:
    lines = [
        "| shape | tokens | triton TFLOP/s | grouped_mm TFLOP/s | selected | dense TFLOP/s | selected/dense"
        " | selected/peak | route triton us | route reference us | align triton us | align torch us |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by_tokens in metrics["fused_moe_tflops"].items():
        for tokens, row in by_tokens.items():
            route, align = metrics["route_us"][name][tokens], metrics["align_us"][name][tokens]
            cells = [name, tokens, row.get("triton", "-"), row.get("grouped_mm", "-"), row["selected"]]
            cells += [row["dense_tflops"], row.get("ratio_selected_to_dense", "-")]
            cells += [row.get("ratio_selected_to_peak", "-"), route["triton"], route["reference"]]
            cells += [align["triton"] if align["triton"] is not None else "-", align["torch"]]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append(f"\n8192^3 bf16 matmul: {metrics['bf16_matmul_tflops']} TFLOP/s")
    lines.append(f"GROUPED_MM_MIN_TOKENS (current): {GROUPED_MM_MIN_TOKENS}")
    lines.append(f"grouped_mm faster from (measured): {metrics['grouped_mm_faster_from_tokens']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_moe_kernels.json"))
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES)
    )
    parser.add_argument("--tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=TOKENS)
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/moe_kernels.py", *sys.argv[1:]])
    metrics: dict[str, Any] = {
        "fused_moe_tflops": {},
        "fused_moe_weight_gb_s": {},
        "route_us": {},
        "align_us": {},
        "grouped_mm_faster_from_tokens": {},
    }
    metrics["bf16_matmul_tflops"] = matmul_peak_tflops()
    for name in args.shapes.split(","):
        bench_shape(name, args.tokens, metrics)
        torch.cuda.empty_cache()
    doc = {
        "command": command,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(metrics)
    args.out.with_suffix(".md").write_text(f"`{command}` on {doc['device']}, {doc['date']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
