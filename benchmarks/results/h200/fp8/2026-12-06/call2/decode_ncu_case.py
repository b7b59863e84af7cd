"""One launch of the paged decode attention per case, for Nsight Compute (warm-ups outside the profiled range).

    ncu --clock-control none --profile-from-start off -k regex:_decode --set full -o decode python3 <this file>
Cases: 4 and 32 rows x 32768 positions (Llama-3.1-8B's 8 kv heads, 128 dims), fp8 and bf16 caches, the
default splits (`choose_num_splits`); then, unprofiled, each case's graph-replay time at PDL on and off.
"""

import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from fp8_kernels import ATTENTION, _decode_case  # noqa: E402
from moe_kernels import graph_ms  # noqa: E402

from tokenspeed.kernels.registry import select_kernel  # noqa: E402

spec = select_kernel("attention", "decode", platform="cuda", dtype=torch.bfloat16, traits={"head_dim": 128})
cases = {}
for batch in (4, 32):
    case = _decode_case("cuda", ATTENTION, batch)
    for cache in ("fp8", "bf16"):
        k, v, s = case[cache]
        cases[(batch, cache)] = (case, lambda case=case, k=k, v=v, s=s: spec.impl(
            case["q"], k, v, case["table"], case["seq_lens"], scale=128**-0.5, **s))
for call in cases.values():
    call[1]()
    call[1]()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for call in cases.values():
    call[1]()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
if os.environ.get("TIME_TOO") == "1":
    for (batch, cache), (case, fn) in cases.items():
        byte = case[cache][0].element_size()
        us = graph_ms(fn, reps=5) * 1e3
        gb_s = case["cached_elements"] * byte / us / 1e3
        print(f"rows {batch} {cache}: {us:.1f} us, {gb_s:.0f} GB/s, PDL={os.environ.get('TOKENSPEED_PDL', '1')}")
