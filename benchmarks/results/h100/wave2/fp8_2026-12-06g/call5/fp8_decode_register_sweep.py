"""fp8-cache decode at 4 and 32 rows x 32K (Llama-3.1-8B heads): bandwidth fraction by launch (positions a
step, stages, register cap `maxnreg`), the bf16 cache beside it. Nsight Compute (call 2) showed the fp8 split
kernel held to 3 programs an SM by its 168 registers and 74 KB of shared memory (bf16: 5), at 66% of DRAM
throughput on an H200. Without a GPU it runs the smoke shape under the interpreter (no register caps)."""

import json
import os
import sys
from typing import Any

import torch

SMOKE = not torch.cuda.is_available()
LAUNCHES = ((128, 2, None), (64, 3, None), (64, 2, 128), (64, 3, 128), (64, 4, 128), (64, 2, 96), (64, 3, 96),
            (128, 2, 128), (32, 3, 96))  # fmt: skip


def sweep(batch: int, shape: dict[str, int], timer: Any, copy: float, dev: str) -> dict[str, Any]:
    from fp8_kernels import _decode_case

    from tokenspeed.kernels.attention.decode_triton import (
        SplitLaunch,
        choose_num_splits,
        decode_attention_triton,
    )

    case = _decode_case(dev, shape, batch)
    default = choose_num_splits(batch, shape["kv_heads"], shape["context"], dev)
    out: dict[str, Any] = {}

    def fraction(cache: str, **kw: Any) -> float | str:
        k, v, scales = case[cache]

        def run() -> torch.Tensor:
            return decode_attention_triton(case["q"], k, v, case["table"], case["seq_lens"], scale=0.088,
                                           num_splits=default, **kw, **scales)  # fmt: skip

        try:
            return round(case["cached_elements"] * k.element_size() / timer.us(run) / 1e3 / copy, 3)
        except Exception as exc:  # a launch that does not build
            return type(exc).__name__

    out[f"rows={batch} bf16 default"] = fraction("bf16")
    for block_n, stages, regs in LAUNCHES if not SMOKE else LAUNCHES[:2]:
        key = f"rows={batch} fp8 block_n={block_n} stages={stages} maxnreg={regs}"
        out[key] = fraction("fp8", launch=SplitLaunch(block_n, stages, regs))
        print(key, out[key], flush=True)
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
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if not SMOKE else "cpu", "copy_gb_s": copy,
                           "fraction": {}}  # fmt: skip
    for batch in (2,) if SMOKE else (4, 32):
        out["fraction"] |= sweep(batch, SMOKE_ATTENTION if SMOKE else ATTENTION, Timer(dev), copy, dev)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
