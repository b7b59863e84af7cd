"""MLA decode kernels on one GPU: bandwidth fraction and the q-head folding speedup.

    python benchmarks/mla_kernels.py --out benchmarks/results/h200_mla_kernels.json [--sweep]

DeepSeek-V3 latent cache (512 latent + 64 rope, bf16, pages of 64 tokens,
pages of each row scattered at random over the pool), 16 heads (Moonlight,
V3 at TP8) and 128 heads (V3 at TP1). Ceilings come from `gpu_suite.ceilings`
in the same run (copy bandwidth: a 2 GiB device-to-device copy, read + write
bytes over time; bf16 matmul rate).

Metrics (keys `h{heads}_b{batch}_ctx{context}_q{q_len}`):
- `mla_decode_bw_fraction`: cache bytes read once (rows x ctx x 576 x 2) /
  time / copy bandwidth, and `mla_decode_us` the median time of a CUDA-graph
  replay of split kernel + merge with L2 flushed before each (`bench_graph_us`);
- `mla_decode_roofline_fraction`: max(bytes / bandwidth, FLOPs / matmul rate)
  / time. 128 heads do 128 x 2 x (576 + 512) FLOPs per 1152 cached bytes,
  which on an H200 is about the machine balance, so q_len > 1 is compute bound
  there and the bandwidth fraction alone undersells it;
- `mla_fold_speedup_qlen4`: unfolded / folded time at q_len 4, with geometric
  means (`geomean` over both head counts is the headline). With 128 heads a
  token's heads already fill the 64-row tile, so folding is a no-op there
  (speedup ~1) by design;
- `mla_extend_tflops`: one 4K-token prompt chunk after a 12K cached prefix;
- with `--sweep`: `mla_decode_launch_sweep`, the decode time of other
  (block_n, num_warps, num_stages) for a few shapes, to retune `default_launch`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_suite  # noqa: E402  (the shared ceilings, timing and result-file helpers)

from tokenspeed.kernels.mla.decode_plan import (  # noqa: E402
    DecodeLaunch,
    block_m_of,
    choose_fold,
    choose_num_splits,
    default_launch,
)
from tokenspeed.kernels.mla.decode_triton import mla_decode_triton  # noqa: E402
from tokenspeed.kernels.mla.extend_triton import mla_extend_triton  # noqa: E402

LATENT, ROPE, PAGE = 512, 64, 64
WIDTH = LATENT + ROPE
SCALE = 192**-0.5
BF16 = torch.bfloat16
HEADS = (16, 128)
BATCHES = (1, 8, 32, 64)
CONTEXTS = (4096, 16384, 65536)
Q_LENS = (1, 2, 4, 8)
CACHE_LIMIT_BYTES = 60 * 2**30
EXTEND_PREFIX, EXTEND_CHUNK = 12288, 4096
DEVICE = "cuda"
RESULTS = gpu_suite.RESULTS
log = gpu_suite.log


def key(heads: int, batch: int, context: int, q_len: int) -> str:
    return f"h{heads}_b{batch}_ctx{context}_q{q_len}"


class Pool:
    """One latent cache big enough for the largest batch x context; each case takes random pages of it."""

    def __init__(self, max_tokens: int) -> None:
        self.num_pages = max_tokens // PAGE
        self.cache = torch.randn(self.num_pages, PAGE, 1, WIDTH, dtype=BF16, device=DEVICE)

    def table(self, batch: int, context: int) -> torch.Tensor:
        pages = context // PAGE
        return (
            torch.randperm(self.num_pages, device=DEVICE)[: batch * pages].view(batch, pages).to(torch.int32)
        )


def bench_graph_us(fn: Callable[[], object]) -> float:
    """Median µs of `fn` replayed from a CUDA graph, L2 flushed before each replay (`do_bench` does).

    The engine runs decode in CUDA graphs, and a graph replay hides the
    Python launch cost (two Triton launches and two allocations, tens of µs)
    that would otherwise swamp a 64K-token row read in ~16 µs. Flushing L2
    stands for the other 60 layers whose caches pass through it in between.
    """
    if DEVICE != "cuda":
        return gpu_suite.bench_ms(fn) * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_suite.bench_ms(graph.replay, reps=20) * 1e3


def time_decode(
    pool: Pool,
    heads: int,
    batch: int,
    context: int,
    q_len: int,
    *,
    fold: int | None = None,
    launch: DecodeLaunch | None = None,
) -> tuple[float, int, torch.Tensor]:
    """(median µs, num_splits, output) of one decode launch (split kernel + merge) over full-length rows.

    Tables and queries come from a generator seeded by the case, so every launch of a case sees the same input.
    """
    torch.manual_seed(hash((heads, batch, context, q_len)) % 2**31)
    table = pool.table(batch, context)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * q_len, heads, WIDTH, dtype=BF16, device=DEVICE)
    splits = choose_num_splits(batch, heads, q_len, context, fold=fold, device=q.device)

    def run() -> torch.Tensor:
        return mla_decode_triton(
            q,
            pool.cache,
            table,
            seq_lens,
            q_len=q_len,
            scale=SCALE,
            kv_lora_rank=LATENT,
            num_splits=splits,
            fold=fold,
            launch=launch,
        )

    return bench_graph_us(run), splits, run()


def decode_section(pool: Pool) -> None:
    bw = gpu_suite.bw()
    rate = gpu_suite.mm_rate()
    fraction: dict[str, float] = {}
    roofline: dict[str, float] = {}
    micros: dict[str, float] = {}
    splits_used: dict[str, int] = {}
    for heads in HEADS:
        for batch in BATCHES:
            for context in CONTEXTS:
                if batch * context * WIDTH * 2 > CACHE_LIMIT_BYTES:
                    continue
                for q_len in Q_LENS:
                    us, splits, _ = time_decode(pool, heads, batch, context, q_len)
                    nbytes = batch * context * WIDTH * 2
                    flops = 2 * batch * q_len * heads * context * (WIDTH + LATENT)
                    k = key(heads, batch, context, q_len)
                    micros[k] = round(us, 1)
                    fraction[k] = round(nbytes / (us / 1e6) / bw, 3)
                    roofline[k] = round(max(nbytes / bw, flops / rate) / (us / 1e6), 3)
                    splits_used[k] = splits
                log(
                    f"decode h{heads} b{batch} ctx{context}: "
                    + " ".join(f"q{q}={fraction[key(heads, batch, context, q)]}" for q in Q_LENS)
                )
    RESULTS["mla_decode_bw_fraction"] = fraction
    RESULTS["mla_decode_roofline_fraction"] = roofline
    RESULTS["mla_decode_us"] = micros
    RESULTS["mla_decode_num_splits"] = splits_used
    for heads in HEADS:
        long_q1 = [
            fraction[key(heads, b, c, 1)]
            for b in BATCHES
            for c in CONTEXTS[1:]
            if key(heads, b, c, 1) in fraction
        ]
        RESULTS[f"mla_decode_bw_fraction_q1_long_context_mean_h{heads}"] = round(
            sum(long_q1) / len(long_q1), 3
        )


def fold_section(pool: Pool) -> None:
    speedups: dict[str, float] = {}
    for heads in HEADS:
        for batch in (8, 32):
            for context in (16384, 65536):
                k = key(heads, batch, context, 4)
                folded = (
                    RESULTS.get("mla_decode_us", {}).get(k) or time_decode(pool, heads, batch, context, 4)[0]
                )
                unfolded, _, _ = time_decode(pool, heads, batch, context, 4, fold=1)
                speedups[k] = round(unfolded / folded, 3)
        log(
            f"fold h{heads}: "
            + " ".join(f"{k}={v}" for k, v in speedups.items() if k.startswith(f"h{heads}_"))
        )

    def geomean(values: list[float]) -> float:
        return round(math.exp(sum(map(math.log, values)) / len(values)), 3)

    speedups["geomean"] = geomean(list(speedups.values()))
    for heads in HEADS:
        speedups[f"geomean_h{heads}"] = geomean(
            [v for k, v in speedups.items() if k.startswith(f"h{heads}_")]
        )
    speedups["fold_h16"] = choose_fold(16, 4)
    speedups["fold_h128"] = choose_fold(128, 4)
    RESULTS["mla_fold_speedup_qlen4"] = speedups


def extend_section(pool: Pool) -> None:
    prefix, chunk = EXTEND_PREFIX, EXTEND_CHUNK
    context = prefix + chunk
    table = pool.table(1, context)
    query_start = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    out: dict[str, float] = {}
    for heads in HEADS:
        q = torch.randn(chunk, heads, WIDTH, dtype=BF16, device=DEVICE)
        ms = gpu_suite.bench_ms(
            lambda q=q: mla_extend_triton(
                q,
                pool.cache,
                query_start,
                seq_lens,
                table,
                scale=SCALE,
                kv_lora_rank=LATENT,
                max_query_len=chunk,
            )
        )
        visible = chunk * prefix + chunk * (chunk + 1) // 2
        out[f"h{heads}_prefix{prefix}_chunk{chunk}"] = round(
            2 * heads * visible * (WIDTH + LATENT) / ms / 1e9, 1
        )
    RESULTS["mla_extend_tflops"] = out
    log(f"extend: {out}")


def sweep_launches() -> list[DecodeLaunch]:
    """Tile sizes with the online ("q") and the anchored ("a") softmax."""
    grid = [(n, w, st) for n in (32, 64) for w in (4, 8) for st in (2, 3)] + [(16, 4, 3)]
    return [DecodeLaunch(n, w, st) for n, w, st in grid] + [
        DecodeLaunch(n, w, st, anchored=True) for n, w, st in grid
    ]


def launch_name(launch: DecodeLaunch) -> str:
    major = "a" if launch.anchored else "q"
    return f"{major}_n{launch.block_n}_w{launch.num_warps}_s{launch.num_stages}"


def sweep_section(pool: Pool) -> None:
    cases = [
        (16, 64, 65536, 1),
        (16, 8, 65536, 1),
        (16, 1, 65536, 1),
        (16, 32, 16384, 1),
        (16, 32, 65536, 2),
        (16, 8, 16384, 4),
        (16, 32, 65536, 8),
        (128, 8, 16384, 1),
    ]
    sweep: dict[str, dict[str, float | str]] = {}
    for heads, batch, context, q_len in cases:
        k = key(heads, batch, context, q_len)
        block_m = block_m_of(heads, choose_fold(heads, q_len))
        us, _, expected = time_decode(pool, heads, batch, context, q_len)
        split_tokens = context // choose_num_splits(batch, heads, q_len, context)
        default = default_launch(block_m, BF16, split_tokens)
        sweep[k] = {"default": launch_name(default), "default_us": round(us, 1)}
        for launch in sweep_launches():
            try:
                us, _, out = time_decode(pool, heads, batch, context, q_len, launch=launch)
                error = (out.float() - expected.float()).abs().max().item()
                sweep[k][launch_name(launch)] = (
                    round(us, 1) if error < 2e-2 else f"wrong output (max err {error:.3g})"
                )
            except Exception as exc:  # out of shared memory / registers: record why
                sweep[k][launch_name(launch)] = f"{type(exc).__name__}"
        log(f"sweep {k}: {sweep[k]}")
    RESULTS["mla_decode_launch_sweep"] = sweep


def markdown() -> str:
    fraction, micros = RESULTS.get("mla_decode_bw_fraction", {}), RESULTS.get("mla_decode_us", {})
    lines = [
        f"copy bandwidth {RESULTS.get('copy_bandwidth_gb_s')} GB/s, bf16 matmul {RESULTS.get('bf16_matmul_tflops')} TFLOP/s",
        "",
        "| heads | batch | context | " + " | ".join(f"q_len {q}: bw frac (µs)" for q in Q_LENS) + " |",
        "|---|---|---|" + "---|" * len(Q_LENS),
    ]
    for heads in HEADS:
        for batch in BATCHES:
            for context in CONTEXTS:
                cells = [key(heads, batch, context, q) for q in Q_LENS]
                if cells[0] in fraction:
                    lines.append(
                        f"| {heads} | {batch} | {context} | "
                        + " | ".join(f"{fraction[c]:.3f} ({micros[c]:.0f})" for c in cells)
                        + " |"
                    )
    speedups = RESULTS.get("mla_fold_speedup_qlen4", {})
    if speedups:
        lines += ["", "| q_len 4 case | folded vs unfolded speedup |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in speedups.items()]
    if "mla_extend_tflops" in RESULTS:
        lines += ["", f"extend TFLOP/s: {RESULTS['mla_extend_tflops']}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_mla_kernels.json"))
    parser.add_argument("--sweep", action="store_true", help="also time other decode launch configurations")
    parser.add_argument(
        "--sections", default="decode,fold,extend", help="comma-separated subset of decode,fold,extend"
    )
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/mla_kernels.py", *sys.argv[1:]])
    start = time.perf_counter()
    gpu_suite.ceilings()
    gpu_suite.free()
    max_tokens = max(b * c for b in BATCHES for c in CONTEXTS if b * c * WIDTH * 2 <= CACHE_LIMIT_BYTES)
    pool = Pool(max_tokens)
    available = {"decode": decode_section, "fold": fold_section, "extend": extend_section}
    sections: list[tuple[str, Any]] = [(name, available[name]) for name in args.sections.split(",") if name]
    if args.sweep:
        sections.append(("sweep", sweep_section))
    for name, section in sections:
        t = time.perf_counter()
        try:
            section(pool)
        except Exception as exc:  # keep what finished: one broken section must not lose the others
            gpu_suite.NOTES.append(f"{name} failed: {type(exc).__name__}: {exc}")
            log(gpu_suite.NOTES[-1])
        gpu_suite.save(args.out, command)
        log(f"{name} took {time.perf_counter() - t:.1f} s")
    table = markdown()
    args.out.with_suffix(".md").write_text(f"`{command}`\n\n{table}\n")
    print(table)
    log(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
