"""fp8-cache decode at 4 and 32 rows x 32K (Llama-3.1-8B heads): bandwidth fraction by launch (positions a
step, stages) and splits per row. A one-off sweep, committed with its output."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import torch
SMOKE = not torch.cuda.is_available()
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
import tokenspeed.kernels.triton_launch  # noqa: F401
from fp8_kernels import ATTENTION, SMOKE_ATTENTION, Timer, _decode_case
from tokenspeed.kernels.attention.decode_triton import SplitLaunch, choose_num_splits, decode_attention_triton
dev = "cpu" if SMOKE else "cuda"
shape = SMOKE_ATTENTION if SMOKE else ATTENTION
timer = Timer(dev)
if SMOKE:
    copy = 1.0
else:
    from gpu_suite import copy_bandwidth_gb_s
    copy = copy_bandwidth_gb_s()
out = {"copy_bandwidth_gb_s": copy, "fraction": {}}
for batch in (4, 32) if not SMOKE else (2,):
    case = _decode_case(dev, shape, batch)
    k, v, scales = case["fp8"]
    default = choose_num_splits(batch, shape["kv_heads"], shape["context"], dev)
    for splits in sorted({default, 32} if batch == 4 else {default}):
        for block_n, stages in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3), (128, 4), (256, 2), (256, 3)):
            run = lambda: decode_attention_triton(case["q"], k, v, case["table"], case["seq_lens"], scale=0.088,
                                                  num_splits=splits, launch=SplitLaunch(block_n, stages), **scales)
            try:
                f = round(case["cached_elements"] / timer.us(run) / 1e3 / copy, 3)
            except Exception as exc:  # a launch that does not build (shared memory)
                f = type(exc).__name__
            out["fraction"][f"rows={batch} splits={splits} block_n={block_n} stages={stages}"] = f
            print(batch, splits, block_n, stages, f, flush=True)
    del case
json.dump(out, open(sys.argv[1], "w"), indent=1)
