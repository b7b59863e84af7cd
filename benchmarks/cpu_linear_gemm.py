"""Small-M fp32 GEMMs on the CPU: `F.linear` (MKL) against pre-packed weights (oneDNN, MKL packed).

    python benchmarks/cpu_linear_gemm.py [--rows 1 4 16 64] [--rounds 7] [--min-time 0.05] [--out FILE]

Why: at 4-16 decode rows the CPU decode forward (`tokenspeed/executor/cpu_decode.py`) of the embedded
model spends ~45% of a step in its GEMMs, and MKL's plain `sgemm` runs `[16, 256] x [256, N]` at
~50 GFLOP/s on one thread of the dev host's EPYC. vLLM's CPU backend and inductor's CPU weight-prepack
pass run linears on weights reordered once into the kernel's blocked layout; this measures whether
the ops torch ships for that beat `F.linear` on the model's real shapes:

- `linear`: `F.linear(x, W)` (the CPU decode forward today; MKL `sgemm` with a transposed B);
- `mm_t`: `torch.mm(x, W.t().contiguous())`: the same kernel on a pre-transposed weight;
- `onednn`: `torch.ops.mkldnn._linear_pointwise(x, Wp, None, "none", [], "")` with
  `Wp = torch.ops.mkldnn._reorder_linear_weight(W, M)` (inductor's path for bf16 / dynamic shapes);
- `mkl_packed`: `torch.ops.mkl._mkl_linear(x, Wm, W, None, M)` with
  `Wm = torch.ops.mkl._mkl_reorder_linear_weight(W, M)` (`cblas_sgemm_pack`: inductor's fp32 static path);
- `onednn_m1`: the oneDNN weight reordered for one row, run at M rows (one packing for every batch size).

Shapes (embedded model: hidden 256, 8 q / 2 kv heads of 32, intermediate 576, vocab 4096): qkv
256->384, o_proj 256->256, gate_up 256->1152, down 576->256, LM head 256->4096. One torch thread;
variants are interleaved round by round (background load hits all alike) and each round reports the
mean time of as many calls as fit in `--min-time`; the table gives the best round and the median.
Also the largest relative difference of each variant from `F.linear` (they round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (256, 384), "o_proj": (256, 256), "gate_up": (256, 1152), "down": (576, 256),
          "lm_head": (256, 4096),
          # a 1-2B model's shapes, for how the choice scales (not run by default)
          "big_o_proj": (2048, 2048), "big_gate_up": (2048, 16384)}
DEFAULT_SHAPES = ["qkv", "o_proj", "gate_up", "down", "lm_head"]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "cpu_linear_gemm.json"


def variants(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each variant as a one-argument call, its weight prepared once (as an engine would at load)."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"linear": lambda x: F.linear(x, weight)}
    transposed = weight.t().contiguous()
    out["mm_t"] = lambda x: torch.mm(x, transposed)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        packed_1 = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["onednn_m1"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_1, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:
        print(f"oneDNN prepack unavailable: {exc}", file=sys.stderr)
    try:
        mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_w, weight, None, rows)
    except (AttributeError, RuntimeError) as exc:
        print(f"MKL prepack unavailable: {exc}", file=sys.stderr)
    return out


def time_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_time: float) -> float:
    """Mean microseconds per call over a batch of calls lasting at least `min_time` seconds."""
    calls = 8
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls * 1e6
        calls *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = []
    for name in args.shapes:
        k, n = SHAPES[name]
        weight = torch.randn(n, k) * k**-0.5
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = variants(weight, rows)
            reference = F.linear(x, weight)
            diffs = {v: float((fn(x) - reference).abs().max() / reference.abs().max()) for v, fn in calls.items()}
            for fn in calls.values():  # warm up
                time_call(fn, x, 0.01)
            samples: dict[str, list[float]] = {v: [] for v in calls}
            for _ in range(args.rounds):
                for v, fn in calls.items():
                    samples[v].append(time_call(fn, x, args.min_time))
            base = min(samples["linear"])
            for v, times in samples.items():
                best, median = min(times), statistics.median(times)
                gflops = 2 * rows * k * n / best / 1e3
                row = {"shape": name, "k": k, "n": n, "rows": rows, "variant": v, "best_us": round(best, 2),
                       "median_us": round(median, 2), "gflops_best": round(gflops, 1),
                       "speedup_best": round(base / best, 3), "max_rel_diff": diffs[v]}
                results.append(row)
                print(f"{name:8s} M={rows:3d} {v:11s} best {best:8.2f} us  median {median:8.2f} us  "
                      f"{gflops:6.1f} GFLOP/s  x{base / best:5.2f}  diff {diffs[v]:.1e}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    args.out.write_text(json.dumps({"command": command, "torch": torch.__version__, "threads": 1,
                                    "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
