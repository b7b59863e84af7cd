"""`comm.fused_allreduce_rmsnorm` (Triton) against the unfused sum + `norm.rms`, on one GPU, simulated worlds.

    python benchmarks/fused_allreduce_rmsnorm.py --out fused_allreduce_rmsnorm.json
    TRITON_INTERPRET=1 python benchmarks/fused_allreduce_rmsnorm.py --smoke   # CPU: tiny shapes, runs once

The N addends are slices of one stacked bf16 tensor on the device, read
through the kernel's peer pointers as peers' buffers would be (so this
measures the kernel's memory traffic, not NVLink). Unfused: the addends
summed in fp32 by torch, cast, then the Triton add+norm kernel; that is the
local work an all-reduce + norm pair does after the transfer. Bandwidth
counts the bytes the fused kernel must move: N addend rows and the residual
read, the new residual and the output written. Every case is first checked
against the reference.

Times are medians of CUDA-graph replays (`graph_us`, how the engine's decode
steps run them, with L2 flushed between replays) and of eager calls
(`eager_us`, which include the host's launch path whenever it is slower than
the GPU); `fused_speedup` is unfused / fused, graph replays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from tokenspeed.kernels.comm.fused_allreduce_rmsnorm_triton import fused_allreduce_rmsnorm_triton
from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.comm.reference import fused_allreduce_rmsnorm_reference
from tokenspeed.kernels.norm.rms_triton import rms_norm_triton


def median_us(fn: Callable[[], object], device: torch.device, *, graph: bool) -> float:
    if device.type != "cuda":  # --smoke: the numbers only show the script runs
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    if not graph:
        return float(do_bench(fn, warmup=5, rep=40, return_mode="median")) * 1e3
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return float(do_bench(cuda_graph.replay, warmup=5, rep=40, return_mode="median")) * 1e3


def run_case(world: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    gen = torch.Generator().manual_seed(world * rows + hidden)
    stacked = torch.randn(world, rows, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    partials = PartialSums.simulated(stacked)
    fused = fused_allreduce_rmsnorm_triton(partials, weight, 1e-5, residual)
    reference = fused_allreduce_rmsnorm_reference(partials, weight, 1e-5, residual)
    if not torch.equal(fused[1], reference[1]):
        raise AssertionError(f"world={world} rows={rows} hidden={hidden}: the summed residual differs")
    torch.testing.assert_close(fused[0], reference[0])

    def unfused() -> object:
        return rms_norm_triton(stacked.float().sum(0).to(dtype), weight, 1e-5, residual)

    def fused_call() -> object:
        return fused_allreduce_rmsnorm_triton(partials, weight, 1e-5, residual)

    times = {
        f"{name}_{mode}_us": round(median_us(fn, device, graph=mode == "graph"), 2)
        for name, fn in (("fused", fused_call), ("unfused", unfused))
        for mode in ("graph", "eager")
    }
    moved = (world + 3) * rows * hidden * stacked.element_size()
    return {
        "world": world, "rows": rows, "hidden": hidden, **times,
        "fused_speedup": round(times["unfused_graph_us"] / times["fused_graph_us"], 2),
        "fused_gb_s": round(moved / times["fused_graph_us"] / 1e3, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one run each (CPU interpreter)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, worlds, rows_list, hiddens = torch.device("cpu"), torch.float16, (1, 2), (1, 3), (64,)
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        device, dtype, worlds, rows_list, hiddens = torch.device("cuda"), torch.bfloat16, (1, 2, 8), (1, 16, 256), (4096, 7168)
    results = [
        run_case(world, rows, hidden, dtype, device) for hidden in hiddens for world in worlds for rows in rows_list
    ]
    for result in results:
        print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": str(device), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
