"""The FP8 MoE experts op at decode sizes the way a decode step runs it: one CUDA graph, layer after layer.

    python benchmarks/moe_decode_stack.py --out benchmarks/results/h100/wave2/moe_decode_stack.json
    python benchmarks/moe_decode_stack.py --smoke --out /tmp/moe_stack_smoke.json   # CPU: interpreter, tiny shape

Why: the decode tiles of `moe.experts_fp8` are picked by `LaunchTuner`, which
times each candidate alone at first use; alone, a launch pays its ramp-up
and an L2 flush that no decode step pays, and for the dense GEMVs such picks
were measured slower than fixed shapes inside the graph (`fp8_gemv_triton`'s
docstring). Nsight Compute on an H100 saw the tuner's pick for Qwen3-30B-A3B
at one token (64-column gate/up tiles) run its gate/up GEMM as 108 programs,
a fifth of a wave, at 47% of the DRAM throughput
(`benchmarks/results/h100/wave2/moe_ncu/`). Here every candidate tile (and
the tuner's own pick) runs LAYERS distinct expert sets (more bytes than the
L2) back to back in one graph, with the alignment and k-sum launches the op
makes; us per layer = replay time / LAYERS (median of `moe_kernels.graph_ms`).
On an H100 (2026-12-06) the tuner's pick was the best tile or within 2% of
it at every size, so the tuner stays
(`benchmarks/results/h100/wave2/moe_decode_tiles_2026-12-06/`).

Metrics (JSON `metrics`, also printed as a markdown table): `copy_bandwidth_gb_s`
(`gpu_suite.py`'s), and per token count `by_tokens[T]`: the expert weight
bytes a layer reads (fp8, the experts the seeded routing hits, with their
block scales), `us[config]` per tile (`tuned` = the tuner's pick, named in
`tuned_config`), `bf16_us` (the bf16 experts op, its default tiles) and the
best tile with its fraction of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from fp8_kernels import save  # benchmarks/ is on sys.path when run as a script
from gemv_stack import stack_setup, timed_us
from gpu_suite import log

SHAPE = (2048, 768, 128, 8)  # Qwen3-30B-A3B: hidden, moe_intermediate, experts, top_k
SMOKE_SHAPE = (128, 64, 8, 2)
TOKENS = (1, 4, 16, 64)
BLOCK = (128, 128)


def extra_tiles() -> list[Any]:
    """Tiles beyond the tuner's candidates: narrower down tiles and two-warp programs (more programs per SM; at
    64 gate/up rows, fewer warp instructions per weight byte: each warp converts the whole activation tile)."""
    from tokenspeed.kernels.moe.experts_triton import TileConfig

    return [
        TileConfig(block_m=16, block_n_up=32, block_n_down=32, block_k=128, num_warps=4, num_stages=4),
        TileConfig(block_m=16, block_n_up=16, block_n_down=32, block_k=128, num_warps=2, num_stages=4),
        TileConfig(block_m=16, block_n_up=32, block_n_down=64, block_k=128, num_warps=2, num_stages=4),
        TileConfig(block_m=16, block_n_up=64, block_n_down=64, block_k=128, num_warps=4, num_stages=3),
        TileConfig(block_m=16, block_n_up=64, block_n_down=128, block_k=128, num_warps=2, num_stages=3),
    ]


class ExpertLayers:
    """`layers` distinct expert sets (fp8 with 128 x 128 block scales, and bf16) and seeded routings."""

    def __init__(self, shape: tuple[int, int, int, int], layers: int, dtype: torch.dtype, dev: str) -> None:
        from tokenspeed.kernels.quant.fp8 import dequantize_weight, quantize_weight_block

        hidden, inter, experts, _ = shape
        gen = torch.Generator(device=dev).manual_seed(0)
        w13, s13 = quantize_weight_block(
            torch.randn(experts, 2 * inter, hidden, generator=gen, device=dev) * hidden**-0.5, BLOCK
        )
        w2, s2 = quantize_weight_block(
            torch.randn(experts, hidden, inter, generator=gen, device=dev) * inter**-0.5, BLOCK
        )
        # Copies: the same values at other addresses, so no layer finds its weights in the L2.
        self.fp8 = [(w13.clone(), s13.clone(), w2.clone(), s2.clone()) for _ in range(layers)]
        bf16 = (dequantize_weight(w13, s13, BLOCK, dtype), dequantize_weight(w2, s2, BLOCK, dtype))
        self.bf16 = [(bf16[0].clone(), bf16[1].clone()) for _ in range(layers)]
        self.shape, self.dtype, self.dev = shape, dtype, dev
        self.expert_bytes = 3 * hidden * inter + (s13[0].numel() + s2[0].numel()) * 4

    def routings(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x, weights, ids) per layer: k distinct experts per token, uniformly at random."""
        from moe_kernels import uniform_routing  # benchmarks/ is on sys.path when run as a script

        hidden, _, experts, top_k = self.shape
        gen = torch.Generator(device=self.dev).manual_seed(tokens)
        out = []
        for layer in range(len(self.fp8)):
            x = torch.randn(tokens, hidden, generator=gen, device=self.dev).to(self.dtype)
            weights, ids = uniform_routing(tokens, experts, top_k, seed=tokens * 1000 + layer, device=self.dev)
            out.append((x, weights, ids))
        return out


def bench_tokens(stack: ExpertLayers, tokens: int, copy_gb_s: float, smoke: bool) -> dict[str, Any]:
    from tokenspeed.kernels.moe.experts_fp8_triton import (
        decode_tile_candidates,
        fused_experts_fp8_triton,
        tuned_decode_tiles,
    )
    from tokenspeed.kernels.moe.experts_triton import fused_experts_triton

    routes = stack.routings(tokens)
    layers = len(routes)
    hit = sum(int(ids.unique().numel()) for _, _, ids in routes) / layers
    nbytes = int(hit * stack.expert_bytes)

    def fp8_step(tiles: Any) -> None:
        for (w13, s13, w2, s2), (x, w, ids) in zip(stack.fp8, routes, strict=True):
            fused_experts_fp8_triton(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, block_size=BLOCK, tiles=tiles,
                                     quantize_activations=False)  # fmt: skip

    def bf16_step() -> None:
        for (w13, w2), (x, w, ids) in zip(stack.bf16, routes, strict=True):
            fused_experts_triton(x, w13, w2, w, ids)

    row: dict[str, Any] = {"experts_hit": round(hit, 1), "fp8_weight_bytes": nbytes, "us": {}}
    # The tuner's pick first (tiles None; the first call outside the graph runs the tuner).
    for name, tiles in [("tuned", None)] + [(repr(t), t) for t in decode_tile_candidates(()) + extra_tiles()]:
        try:
            row["us"][name] = round(timed_us(lambda t=tiles: fp8_step(t), smoke) / layers, 2)
        except (ValueError, RuntimeError) as exc:  # a failed build: the others still run
            log(f"T={tokens} {name}: {type(exc).__name__}: {str(exc)[:160]}")
    tuned = tuned_decode_tiles().get((tokens, *stack.shape, stack.dtype, BLOCK))  # the op's tuner key
    row["tuned_config"] = repr(tuned.config) if tuned else None
    best = min((k for k in row["us"] if k != "tuned"), key=row["us"].__getitem__)
    row |= {"best_config": best, "best_us": row["us"][best],
            "best_fraction": round(nbytes / row["us"][best] / 1e3 / copy_gb_s, 3),
            "tuned_fraction": round(nbytes / row["us"]["tuned"] / 1e3 / copy_gb_s, 3) if "tuned" in row["us"] else None,
            "bf16_us": round(timed_us(bf16_step, smoke) / layers, 2)}  # fmt: skip
    log(f"T={tokens}: tuned {row['us'].get('tuned')} us, best {row['best_us']} us {row['best_config']}")
    return row


def markdown(metrics: dict[str, Any]) -> str:
    lines = [f"copy {metrics['copy_bandwidth_gb_s']} GB/s; {metrics['layers']} layers a graph; us per layer "
             "(the experts op: alignment, gate/up, down, k-sum)", "",
             "| tokens | experts hit | tuned (fraction) | tuned config | best (fraction) | best config | bf16 |",
             "|---:|---:|---:|---|---:|---|---:|"]  # fmt: skip
    for tokens, r in metrics["by_tokens"].items():
        lines.append(f"| {tokens} | {r['experts_hit']} | {r['us'].get('tuned')} ({r['tuned_fraction']}) | "
                     f"{r['tuned_config']} | {r['best_us']} ({r['best_fraction']}) | {r['best_config']} | {r['bf16_us']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe_decode_stack.json"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, tiny shape (tests the script)"
    )
    args = parser.parse_args()
    run = stack_setup(parser, args, "moe_decode_stack.py")
    metrics = run.metrics
    del metrics["forms"]  # gemv_stack's; this script reports by token count
    metrics["by_tokens"] = {}
    stack = ExpertLayers(SMOKE_SHAPE if args.smoke else SHAPE, run.layers, run.dtype, run.dev)
    for tokens in map(int, args.tokens.split(",")):
        metrics["by_tokens"][str(tokens)] = bench_tokens(stack, tokens, metrics["copy_bandwidth_gb_s"], args.smoke)
        save(args.out, run.command, run.device, metrics)  # rewritten after each size: a timeout keeps what finished
    run.finish(args.out, markdown(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
