"""fp8-cache decode at 4 and 32 rows x 32K (Llama-3.1-8B heads): bandwidth fraction by launch (positions a
step, stages) and splits per row. A one-off sweep, committed with its output (`steps.sh` ran it; tidied for
the linter after the run, same calls). Without a GPU it runs the smoke shape under the interpreter."""

import json
import os
import sys
from typing import Any

import torch

SMOKE = not torch.cuda.is_available()
LAUNCHES = ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3), (128, 4), (256, 2), (256, 3))


def sweep(batch: int, shape: dict[str, int], timer: Any, copy: float, dev: str) -> dict[str, Any]:
    from fp8_kernels import _decode_case

    from tokenspeed.kernels.attention.decode_triton import (
        SplitLaunch,
        choose_num_splits,
        decode_attention_triton,
    )

    case = _decode_case(dev, shape, batch)
    k, v, scales = case["fp8"]
    default = choose_num_splits(batch, shape["kv_heads"], shape["context"], dev)
    out: dict[str, Any] = {}
    for splits in sorted({default, 32} if batch == 4 else {default}):
        for block_n, stages in LAUNCHES:
            launch = SplitLaunch(block_n, stages)

            def run(splits: int = splits, launch: SplitLaunch = launch) -> torch.Tensor:
                return decode_attention_triton(case["q"], k, v, case["table"], case["seq_lens"], scale=0.088,
                                               num_splits=splits, launch=launch, **scales)  # fmt: skip

            try:
                f: float | str = round(case["cached_elements"] / timer.us(run) / 1e3 / copy, 3)
            except Exception as exc:  # a launch that does not build (shared memory)
                f = type(exc).__name__
            out[f"rows={batch} splits={splits} block_n={block_n} stages={stages}"] = f
            print(batch, splits, block_n, stages, f, flush=True)
    return out


def main() -> None:
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "benchmarks")
    from fp8_kernels import ATTENTION, SMOKE_ATTENTION, Timer

    import tokenspeed.kernels.triton_launch  # noqa: F401  (patches the interpreter when it is on)

    dev = "cpu" if SMOKE else "cuda"
    copy = 1.0
    if not SMOKE:
        from gpu_suite import copy_bandwidth_gb_s

        copy = copy_bandwidth_gb_s()
    out: dict[str, Any] = {"copy_bandwidth_gb_s": copy, "fraction": {}}
    for batch in (2,) if SMOKE else (4, 32):
        out["fraction"] |= sweep(batch, SMOKE_ATTENTION if SMOKE else ATTENTION, Timer(dev), copy, dev)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
