"""FP8 kernels on one GPU, against ceilings measured in the same run.

    python benchmarks/fp8_kernels.py --out benchmarks/results/h200/fp8/fp8_kernels.json [--sweep]
    python benchmarks/fp8_kernels.py --smoke --out /tmp/fp8_kernels_smoke.json   # CPU: interpreter, tiny shapes

Ceilings (`ceilings`): copy bandwidth measured as `gpu_suite.py` measures it
(an eager 2 GiB device-to-device copy, bytes read + written over the median
time; every bandwidth fraction below divides by it), the same copy replayed
from a CUDA graph (`copy_graph_replay_gb_s`, a diagnostic: the first run used
it as the ceiling, 2767 against 4273 GB/s, which inflated every fraction
1.54x), the bf16 matmul rate and the fp8 `torch._scaled_mm` rate (8192^3,
per-tensor scales), both on random data.

Every kernel is timed as a CUDA-graph replay (`moe_kernels.graph_ms`: median
of `triton.testing.do_bench` over ~50 ms of replays, L2 flushed between
them), the way the engine runs them, after one eager call on a side stream
(compiles, and runs the kernels' per-shape launch tuners,
`kernels/autotune.py`); a capture failure falls back to eager timing and is
logged.

Metrics (JSON `metrics`, also printed as markdown tables):
- `gemm[shape][M]`: Llama-3.1-8B's projections (qkv 6144x4096, o 4096x4096,
  gate_up 28672x4096, down 4096x14336) at M = 4, 16, 256, 4096 tokens, in
  TFLOP/s: `selected` (the kernel the per-batch dispatch picks, 128 x 128
  weight blocks, activation quantisation included: what a layer pays),
  `selected_per_channel` (the same with per-channel weight scales), `triton`
  (the Triton GEMM with its quantisation), `triton_gemm_only` (activations
  already quantised, as `_scaled_mm` gets them), torch's `scaled_mm_rowwise`
  (per-row / per-column scales) and `scaled_mm_tensorwise` on pre-quantised
  operands, each also with fast accumulation (`_fast`), and `bf16` (cuBLAS);
  `selected_vs_scaled_mm_rowwise` is the ratio; `cublas_formats`: which
  scalings cuBLAS took on this device (`gemm/fp8_scaled_mm.py`);
- `gemv[shape]`, one token, timed alone: the FP8 GEMV at its launch shape
  (`config`; `gemv_stack.py` times every shape as a decode step runs them), against
  its byte roofline (fp8 weight + scales + activation + output bytes / copy
  bandwidth; `roofline_fraction` = roofline time / time), and the bf16
  cuBLAS GEMV and bf16 Triton GEMV (the engine's bf16 decode path) beside it;
- `decode_attention`: the paged decode kernel over 32 rows x 32K tokens of
  Llama-3.1-8B attention (32 / 8 heads x 128, pages of 16), fp8 cache with
  per-head scales vs bf16 cache: time and bandwidth fraction (cache bytes /
  time / copy bandwidth; target >= 0.75 for fp8); `split_sweep`: the
  same fraction at other splits per row (`num_splits`) than the default, at
  32 and at 4 rows (the 4 x 32K decode of `fp8_e2e.py --sections kv_long`);
- `moe[T]`: Qwen3-30B-A3B experts (hidden 2048, intermediate 768, 128
  experts, top-8, 128 x 128 blocks) at T = 1, 64, 1024 tokens, uniformly
  random routing: fp8 and bf16 Triton kernels, time, fp8 operand precision
  (`w8a16` decode tiles / `w8a8`), the decode tiles the tuner chose, weight
  bytes of the experts hit / time and its fraction of the copy bandwidth;
- with `--sweep`: `gemm_tile_sweep`, the Triton GEMM at other tiles.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_suite import log  # benchmarks/ is on sys.path when run as a script

GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_GEMM_SHAPES = {"qkv": (96, 128), "down": (64, 384)}
ATTENTION = dict(batch=32, context=32768, heads=32, kv_heads=8, dim=128, page=16)
SMOKE_ATTENTION = dict(batch=2, context=64, heads=4, kv_heads=2, dim=32, page=16)
MOE = dict(hidden=2048, inter=768, experts=128, top_k=8)
SMOKE_MOE = dict(hidden=256, inter=128, experts=8, top_k=2)
BLOCK = (128, 128)


class Timer:
    """Median µs of a callable: CUDA-graph replays on the GPU, wall clock under the CPU interpreter."""

    def __init__(self, device: str) -> None:
        self.device = device

    def us(self, fn: Callable[[], Any]) -> float:
        if self.device == "cpu":  # --smoke: the numbers only show the script runs
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        from moe_kernels import graph_ms  # benchmarks/ is on sys.path when run as a script

        return graph_ms(fn, reps=5) * 1e3  # ~50 ms of replays: enough samples for these 5 us - 1 ms kernels


def ceilings(timer: Timer, smoke: bool) -> dict[str, float | None]:
    dev = timer.device
    if dev == "cuda":
        from gpu_suite import copy_bandwidth_gb_s  # benchmarks/ is on sys.path when run as a script

        copy_gb_s = copy_bandwidth_gb_s()
        a = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)  # diagnostic: the same copy, replayed
        b = torch.empty_like(a)
        copy_graph_gb_s: float | None = round(2 * a.numel() * 2 / timer.us(lambda: b.copy_(a)) / 1e3, 1)
        del a, b
    else:
        a = torch.randn(1 << 20, device=dev)
        b = torch.empty_like(a)
        copy_gb_s = round(2 * a.numel() * 4 / timer.us(lambda: b.copy_(a)) / 1e3, 1)
        copy_graph_gb_s = None
    m = 256 if smoke else 8192
    x = torch.randn(m, m, device=dev).to(torch.bfloat16)
    y = torch.randn(m, m, device=dev).to(torch.bfloat16)
    bf16 = 2 * m**3 / timer.us(lambda: x @ y) / 1e6
    fp8 = None
    if dev == "cuda":
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=dev)
        mm = lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16)  # noqa: E731
        fp8 = round(2 * m**3 / timer.us(mm) / 1e6, 1)
    return {
        "copy_bandwidth_gb_s": copy_gb_s,
        "copy_graph_replay_gb_s": copy_graph_gb_s,
        "bf16_matmul_tflops": round(bf16, 1),
        "fp8_scaled_mm_tflops": fp8,
    }


def _tflops(m: int, n: int, k: int, us: float) -> float:
    return round(2 * m * n * k / us / 1e6, 2)


def bench_gemm(
    timer: Timer, shapes: dict[str, tuple[int, int]], tokens: tuple[int, ...], sweep: bool
) -> dict[str, Any]:
    from tokenspeed.kernels.gemm.fp8_dispatch import select_fp8_gemm_by_batch
    from tokenspeed.kernels.gemm.fp8_gemm_triton import fp8_gemm_prequantized, fp8_gemm_triton
    from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK, quantize_weight_block
    from tokenspeed.kernels.quant.quantize_triton import quantize_per_token_group_triton

    dev, dtype = timer.device, torch.bfloat16 if timer.device == "cuda" else torch.float32
    dispatch = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    results: dict[str, Any] = {}
    sweeps: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        w8, w_scale = quantize_weight_block(w, BLOCK)
        w8c, w_scale_c = quantize_weight_block(w, PER_CHANNEL_BLOCK)
        w_bf16 = w.to(dtype)
        for m in tokens:
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            a8, a_scale = quantize_per_token_group_triton(x)
            out = torch.empty(m, n, dtype=dtype, device=dev)
            row: dict[str, Any] = {"selected": dispatch.kernel_for(m).name}
            row["selected_tflops"] = _tflops(m, n, k, timer.us(partial(dispatch, x, w8, w_scale)))
            row["selected_per_channel"] = _tflops(
                m, n, k, timer.us(partial(dispatch, x, w8c, w_scale_c, block_size=PER_CHANNEL_BLOCK))
            )
            row["triton"] = _tflops(m, n, k, timer.us(partial(fp8_gemm_triton, x, w8, w_scale)))
            prequantized = partial(fp8_gemm_prequantized, a8, a_scale, w8, w_scale, out, block_size=BLOCK)
            row["triton_gemm_only"] = _tflops(m, n, k, timer.us(prequantized))
            row["bf16"] = _tflops(m, n, k, timer.us(partial(torch.matmul, x, w_bf16.t())))
            if dev == "cuda":
                row |= scaled_mm_rates(timer, x, w8, m, n, k)
                row["selected_vs_scaled_mm_rowwise"] = round(
                    row["selected_tflops"] / row["scaled_mm_rowwise"], 3
                )
            results.setdefault(name, {})[str(m)] = row
            log(f"gemm {name} M={m}: {row}")
            if sweep:
                rates = {}
                for tiles in GEMM_SWEEP:
                    label = f"{tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
                    rates[label] = _tflops(m, n, k, timer.us(partial(prequantized, tiles=tiles)))
                sweeps.setdefault(name, {})[str(m)] = rates
    formats = {}
    if dev == "cuda":
        from tokenspeed.kernels.gemm.fp8_scaled_mm import cublas_formats

        formats = {fmt: ok for (_, fmt), ok in cublas_formats().items()}
    return {"gemm": results, "cublas_formats": formats} | ({"gemm_tile_sweep": sweeps} if sweep else {})


def scaled_mm_rates(
    timer: Timer, x: torch.Tensor, w8: torch.Tensor, m: int, n: int, k: int
) -> dict[str, float]:
    """`torch._scaled_mm` on the same operands, with its own scales: per row/column and per tensor."""
    x8 = x.to(torch.float8_e4m3fn)
    b = w8.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    rows, cols = torch.rand(m, 1, device=x.device) + 0.5, torch.rand(1, n, device=x.device) + 0.5
    one = torch.ones((), device=x.device)
    rates = {}
    for label, (sa, sb) in {"rowwise": (rows, cols), "tensorwise": (one, one)}.items():
        for fast in (False, True):
            mm = lambda sa=sa, sb=sb, fast=fast: torch._scaled_mm(  # noqa: E731
                x8, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
            key = f"scaled_mm_{label}" + ("_fast" if fast else "")
            try:  # a torch build may refuse a variant: record why rather than lose the run
                rates[key] = _tflops(m, n, k, timer.us(mm))
            except RuntimeError as exc:
                rates[key] = f"unavailable: {str(exc).splitlines()[0][:200]}"
    return rates


def bench_gemv(timer: Timer, shapes: dict[str, tuple[int, int]], copy_gb_s: float) -> dict[str, Any]:
    """One token, one kernel alone: the fp8 GEMV at its chosen launch shape, against its byte roofline and bf16
    (`gemv_stack.py` times the decode step's view: every shape, layer after layer in one graph)."""
    from tokenspeed.kernels.gemm.fp8_gemv_triton import choose_config, fp8_gemv_triton
    from tokenspeed.kernels.gemm.gemv_triton import gemv_triton
    from tokenspeed.kernels.quant.fp8 import quantize_weight_block

    dev, dtype = timer.device, torch.bfloat16 if timer.device == "cuda" else torch.float32
    results: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(n * 3 + k)
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        w8, w_scale = quantize_weight_block(w, BLOCK)
        w_bf16 = w.to(dtype)
        x = torch.randn(1, k, generator=gen, device=dev).to(dtype)
        us = timer.us(partial(fp8_gemv_triton, x, w8, w_scale))
        moved = w8.numel() + w_scale.numel() * 4 + (k + n) * x.element_size()
        roofline_us = moved / copy_gb_s / 1e3
        bf16_us = timer.us(partial(torch.matmul, x, w_bf16.t()))
        bf16_gemv_us = timer.us(partial(gemv_triton, x, w_bf16))
        row = {
            "us": round(us, 2),
            "roofline_us": round(roofline_us, 2),
            "roofline_fraction": round(roofline_us / us, 3),
            "bf16_cublas_us": round(bf16_us, 2),
            "bf16_triton_gemv_us": round(bf16_gemv_us, 2),
            "speedup_vs_bf16": round(min(bf16_us, bf16_gemv_us) / us, 2),
            "config": repr(choose_config(k)),
        }
        results[name] = row
        log(f"gemv {name}: {row}")
    return {"gemv": results}


def _decode_case(dev: str, shape: dict[str, int], batch: int) -> dict[str, Any]:
    """`batch` rows of `shape`'s context: bf16 (fp32 on the CPU) and fp8 caches (per-head scales), pages shuffled."""
    from tokenspeed.kernels.quant.fp8 import FP8_DTYPE

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    context, page, kv_heads, dim = shape["context"], shape["page"], shape["kv_heads"], shape["dim"]
    pages_per_row = context // page
    num_pages = batch * pages_per_row
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen, device=dev).to(dtype)
    scale = torch.full((kv_heads,), 1.0 / 64, device=dev)
    return {
        "q": torch.randn(batch, shape["heads"], dim, generator=gen, device=dev).to(dtype),
        "bf16": (k_cache, v_cache, {}),
        "fp8": ((k_cache.float() * 64).to(FP8_DTYPE), (v_cache.float() * 64).to(FP8_DTYPE),
                {"k_scale": scale, "v_scale": scale}),
        "table": torch.randperm(num_pages, generator=gen, device=dev).view(batch, pages_per_row).to(torch.int32),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
        "cached_elements": 2 * batch * context * kv_heads * dim,
    }  # fmt: skip


def bench_decode_attention(
    timer: Timer, shape: dict[str, int], copy_gb_s: float, split_sweep: tuple[int, ...]
) -> dict[str, Any]:
    from tokenspeed.kernels.attention.decode_plan import choose_num_splits, fp8_launch_candidates
    from tokenspeed.kernels.attention.decode_triton import tuned_fp8_launches
    from tokenspeed.kernels.registry import select_kernel

    dev = timer.device
    # The kernel the GPU gets (--smoke runs it under the interpreter).
    spec = select_kernel("attention", "decode", platform="cuda", dtype=torch.bfloat16 if dev == "cuda" else
                         torch.float32, traits={"head_dim": shape["dim"]})  # fmt: skip
    scale = shape["dim"] ** -0.5

    def us(case: dict[str, Any], cache: str, **kw: Any) -> float:
        k, v, scales = case[cache]
        return timer.us(lambda: spec.impl(case["q"], k, v, case["table"], case["seq_lens"], scale=scale, **scales,
                                          **kw))  # fmt: skip

    def fraction(case: dict[str, Any], cache: str, t: float) -> float:
        return round(case["cached_elements"] * case[cache][0].element_size() / t / 1e3 / copy_gb_s, 3)

    case = _decode_case(dev, shape, shape["batch"])
    bf16_us, fp8_us = us(case, "bf16"), us(case, "fp8")
    result: dict[str, Any] = {
        "kernel": spec.name,
        **shape,
        "bf16_ms": round(bf16_us / 1e3, 4),
        "bf16_bw_fraction": fraction(case, "bf16", bf16_us),
        "fp8_ms": round(fp8_us / 1e3, 4),
        "fp8_bw_fraction": fraction(case, "fp8", fp8_us),
        "fp8_speedup": round(bf16_us / fp8_us, 2),
        # the fp8 launch its tuner took (timed on its own few long rows, `tuning_case`) and each candidate's time
        "fp8_launches": {repr(key): {"launch": repr(c.config), "timed_us": c.timings_us}
                         for key, c in tuned_fp8_launches().items()},
    }
    del case
    # Splits per row against the default (`choose_num_splits`), at this batch and at the 4 long rows of
    # fp8_e2e.py's kv_long: bandwidth fraction per cache (the fp8 cache at its tuned launch), and at every fp8 launch.
    sweep: dict[str, Any] = {}
    for batch in sorted({shape["batch"], min(4, shape["batch"])}):
        case = _decode_case(dev, shape, batch)
        default = choose_num_splits(batch, shape["kv_heads"], shape["context"], dev)
        by_splits = {}
        for splits in sorted({default, *split_sweep}):
            by_splits[splits] = {cache: fraction(case, cache, us(case, cache, num_splits=splits))
                                 for cache in ("bf16", "fp8")}  # fmt: skip
        by_launch = {splits: {repr(launch): fraction(case, "fp8", us(case, "fp8", num_splits=splits, launch=launch))
                              for launch in fp8_launch_candidates((shape["dim"],))}
                     for splits in sorted({default, *split_sweep})}  # fmt: skip
        sweep[f"batch {batch}"] = {"default_splits": default, "bw_fraction_by_splits": by_splits,
                                   "fp8_bw_fraction_by_splits_and_launch": by_launch}  # fmt: skip
        del case
    result["split_sweep"] = sweep
    log(f"decode attention: {result}")
    return {"decode_attention": result}


def bench_moe(
    timer: Timer, shape: dict[str, int], tokens: tuple[int, ...], copy_gb_s: float
) -> dict[str, Any]:
    from tokenspeed.kernels.moe.experts_fp8_triton import fused_experts_fp8_triton, tuned_decode_tiles
    from tokenspeed.kernels.moe.experts_triton import DECODE_TILES, fused_experts_triton, tile_config
    from tokenspeed.kernels.quant.fp8 import dequantize_weight, quantize_weight_block

    dev = timer.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hidden, inter, experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gen = torch.Generator(device=dev).manual_seed(1)
    w13, s13 = quantize_weight_block(
        torch.randn(experts, 2 * inter, hidden, generator=gen, device=dev) * hidden**-0.5, BLOCK
    )
    w2, s2 = quantize_weight_block(
        torch.randn(experts, hidden, inter, generator=gen, device=dev) * inter**-0.5, BLOCK
    )
    w13_bf16, w2_bf16 = dequantize_weight(w13, s13, BLOCK, dtype), dequantize_weight(w2, s2, BLOCK, dtype)
    results: dict[str, Any] = {}
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device=dev).to(dtype)
        ids = torch.rand(t, experts, generator=gen, device=dev).topk(top_k, dim=-1).indices.to(torch.int32)
        weights = torch.randn(t, top_k, generator=gen, device=dev).softmax(dim=-1)
        fp8 = partial(fused_experts_fp8_triton, x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
        fp8_us = timer.us(fp8)
        bf16_us = timer.us(partial(fused_experts_triton, x, w13_bf16, w2_bf16, weights, ids))
        hit = int(ids.unique().numel())
        weight_bytes = hit * (3 * inter * hidden + (s13[0].numel() + s2[0].numel()) * 4)
        row = {
            "fp8_us": round(fp8_us, 2),
            "bf16_us": round(bf16_us, 2),
            "fp8_speedup": round(bf16_us / fp8_us, 2),
            "operands": "w8a16" if tile_config(t, top_k, experts) == DECODE_TILES else "w8a8",
            "experts_hit": hit,
            "fp8_weight_gb_s": round(weight_bytes / fp8_us / 1e3, 1),
            "fp8_weight_bw_fraction": round(weight_bytes / fp8_us / 1e3 / copy_gb_s, 3),
            "fp8_tflops": _tflops(t * top_k, 3 * inter, hidden, fp8_us),
        }
        choice = tuned_decode_tiles().get((t, hidden, inter, experts, top_k, dtype, BLOCK))
        if choice is not None:  # decode-sized: the tiles its tuner chose, and each candidate's time
            row |= {"tiles": repr(choice.config), "candidates_us": choice.timings_us}
        results[str(t)] = row
        log(f"moe T={t}: {row}")
    return {"moe": {"shape": shape, "by_tokens": results}}


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(x) for x in cells) + " |"


def _attention_lines(a: dict[str, Any]) -> list[str]:
    """The decode attention section of `markdown`: the headline, splits per row, every fp8 launch."""
    lines = ["", f"decode attention ({a['kernel']}, {a['batch']} x {a['context']}): fp8 {a['fp8_ms']} ms "
             f"(bw fraction {a['fp8_bw_fraction']}), bf16 {a['bf16_ms']} ms ({a['bf16_bw_fraction']}), "
             f"speedup {a['fp8_speedup']}", "",
             "| rows | splits per row | bf16 bw fraction | fp8 bw fraction |", "|---|---:|---:|---:|"]  # fmt: skip
    for rows, sweep in a.get("split_sweep", {}).items():
        for splits, r in sweep["bw_fraction_by_splits"].items():
            mark = " (default)" if int(splits) == sweep["default_splits"] else ""
            lines.append(_row([rows, f"{splits}{mark}", r["bf16"], r["fp8"]]))
    lines += ["", "| rows | splits per row | fp8 launch | fp8 bw fraction |", "|---|---:|---|---:|"]
    for rows, sweep in a.get("split_sweep", {}).items():
        for splits, by_launch in sweep.get("fp8_bw_fraction_by_splits_and_launch", {}).items():
            lines += [_row([rows, splits, launch, f]) for launch, f in by_launch.items()]
    return lines


def markdown(metrics: dict[str, Any]) -> str:
    c = metrics["ceilings"]
    lines = [f"ceilings: copy {c['copy_bandwidth_gb_s']} GB/s (every fraction below divides by it; the same copy "
             f"replayed from a CUDA graph: {c['copy_graph_replay_gb_s']} GB/s), bf16 {c['bf16_matmul_tflops']} "
             f"TFLOP/s, fp8 scaled_mm {c['fp8_scaled_mm_tflops']} TFLOP/s; cuBLAS formats taken: "
             f"{metrics.get('cublas_formats')}", "",
             "TFLOP/s (selected: the per-batch dispatch with 128x128 blocks, incl. activation quantisation; "
             "per-channel: the same with per-channel weights; scaled_mm rowwise/tensorwise: torch on "
             "pre-quantised operands)", "",
             "| gemm | M | selected | TFLOP/s | per-channel | triton | gemm only | scaled_mm rowwise | tensorwise "
             "| bf16 | selected / rowwise |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, by_m in metrics.get("gemm", {}).items():
        for m, r in by_m.items():
            lines.append(_row([
                name, m, r["selected"], r["selected_tflops"], r["selected_per_channel"], r["triton"],
                r["triton_gemm_only"], r.get("scaled_mm_rowwise", "-"), r.get("scaled_mm_tensorwise", "-"),
                r["bf16"], r.get("selected_vs_scaled_mm_rowwise", "-"),
            ]))  # fmt: skip
    lines += ["", "| gemv (1 token) | us | roofline us | fraction | bf16 cuBLAS us | bf16 Triton GEMV us | speedup "
              "| tuned config |", "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, r in metrics.get("gemv", {}).items():
        lines.append(_row([
            name, r["us"], r["roofline_us"], r["roofline_fraction"], r["bf16_cublas_us"], r["bf16_triton_gemv_us"],
            r["speedup_vs_bf16"], r["config"],
        ]))  # fmt: skip
    if "decode_attention" in metrics:
        lines += _attention_lines(metrics["decode_attention"])
    lines += ["",
              "| moe T | operands | fp8 us | bf16 us | speedup | weight GB/s | bw fraction | TFLOP/s | tiles |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for t, r in metrics.get("moe", {}).get("by_tokens", {}).items():
        lines.append(_row([
            t, r["operands"], r["fp8_us"], r["bf16_us"], r["fp8_speedup"], r["fp8_weight_gb_s"],
            r["fp8_weight_bw_fraction"], r["fp8_tflops"], r.get("tiles", "-"),
        ]))  # fmt: skip
    return "\n".join(lines)


def _sweep_configs() -> None:
    """Fill GEMM_SWEEP (the kernel modules import triton, so only after the mode is set)."""
    from tokenspeed.kernels.gemm.fp8_gemm_triton import Fp8GemmTiles

    GEMM_SWEEP.extend(
        Fp8GemmTiles(*t)
        for t in (
            (64, 128, 4, 4),
            (64, 256, 8, 3),
            (128, 128, 8, 3),
            (128, 128, 8, 4),
            (128, 256, 8, 3),
            (64, 64, 4, 4),
        )
    )


GEMM_SWEEP: list[Any] = []
SECTIONS = ("gemm", "gemv", "decode_attention", "moe")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/fp8/fp8_kernels.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (tests the script)")
    parser.add_argument("--sweep", action="store_true", help="also time other tiles of the Triton GEMM")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    args = parser.parse_args()
    chosen = args.sections.split(",")
    if unknown := set(chosen) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    import tokenspeed.kernels.triton_launch  # noqa: F401  (patches the interpreter when it is on)

    timer = Timer("cpu" if args.smoke else "cuda")
    _sweep_configs()
    command = " ".join(["python", "benchmarks/fp8_kernels.py", *sys.argv[1:]])
    device = torch.cuda.get_device_name() if timer.device == "cuda" else "cpu (Triton interpreter, smoke)"
    metrics: dict[str, Any] = {"ceilings": ceilings(timer, args.smoke)}
    log(f"ceilings: {metrics['ceilings']}")
    copy = metrics["ceilings"]["copy_bandwidth_gb_s"]
    shapes = SMOKE_GEMM_SHAPES if args.smoke else GEMM_SHAPES
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "gemm": partial(bench_gemm, timer, shapes, (2, 20) if args.smoke else (4, 16, 256, 4096), args.sweep),
        "gemv": partial(bench_gemv, timer, shapes, copy),
        "decode_attention": partial(bench_decode_attention, timer, SMOKE_ATTENTION if args.smoke else ATTENTION,
                                    copy, (2, 4) if args.smoke else (8, 16, 32, 64, 128)),  # fmt: skip
        "moe": partial(
            bench_moe, timer, SMOKE_MOE if args.smoke else MOE, (1, 8) if args.smoke else (1, 64, 1024), copy
        ),
    }
    for name in (n for n in SECTIONS if n in chosen):  # the file is rewritten after each: a timeout keeps those done
        metrics |= sections[name]()
        date = save(args.out, command, device, metrics)
    table = markdown(metrics)
    args.out.with_suffix(".md").write_text(f"`{command}` on {device}, {date}\n\n{table}\n")
    print(table)
    return 0


def save(path: Path, command: str, device: str, metrics: dict[str, Any]) -> str:
    """Write the result file `{"command", "device", "date", "metrics"}`; returns the date."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "device": device, "date": date, "metrics": metrics}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return date


if __name__ == "__main__":
    sys.exit(main())
