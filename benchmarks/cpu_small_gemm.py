"""Few-row fp32 GEMMs on the CPU, one thread: MKL (`F.linear`), oneDNN on a pre-packed weight, and the
native small GEMM (`kernels/cpu_small_gemm.py`), on the embedded model's weight shapes.

    python benchmarks/cpu_small_gemm.py [--rows 1 4 8 16 32] [--repeat 300] [--out FILE]

Median microseconds of `--repeat` calls of each (after 20 warm-up calls; weights hot in cache, so the
decode step's own A/B in `cpu_decode_step.py` is the measure that counts), and the small GEMM's largest
absolute difference from `F.linear`. Results go to `--out` (default
`benchmarks/results/cpu/cpu_small_gemm.json`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_results import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_small_gemm.json"
SHAPES = {"qkv": (384, 256), "o_proj": (256, 256), "gate_up": (1152, 256), "down": (256, 576), "lm_head": (4096, 256)}


def median_us(repeat: int, fn: Any, *args: Any) -> float:
    for _ in range(20):
        fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from tokenspeed.kernels import cpu_small_gemm

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, shape in SHAPES.items():
        weight = torch.randn(shape) * shape[1] ** -0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        few = cpu_small_gemm.small_gemm(weight)
        assert few is not None, "the native small GEMM did not build"
        for rows in args.rows:
            x = torch.randn(rows, shape[1])
            row = {
                "mkl_us": median_us(args.repeat, F.linear, x, weight),
                "onednn_us": median_us(args.repeat, torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
                "small_us": median_us(args.repeat, few, x),
                "max_abs_diff": float((few(x) - F.linear(x, weight)).abs().max()),
            }
            results[f"{name}_{rows}"] = row
            print(f"{name} {shape} rows={rows}: {row}", flush=True)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
