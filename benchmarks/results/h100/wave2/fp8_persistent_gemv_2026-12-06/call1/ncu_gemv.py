"""Launch each decode GEMV variant once between cudaProfilerStart/Stop, for `ncu --profile-from-start off`."""
import os
import sys

sys.path.insert(0, "benchmarks")
import torch
from gemv_stack import FORMS, Layers
from tokenspeed.kernels.gemm.fp8_gemv_persistent_triton import persistent_shapes

picks = [persistent_shapes()[int(i)] for i in os.environ.get("PICKS", "0").split(",")]
stacks = {f: Layers(f, *FORMS[f], 2, torch.bfloat16, "cuda") for f in ("qkv", "o", "gate_up")}
variants = []
for f, s in stacks.items():
    variants.append((f"{f} fp8 per-tile chosen", lambda s=s: s.fp8_one(0)))
    for c in picks:
        variants.append((f"{f} fp8 {c}", lambda s=s, c=c: s.fp8_one(0, c)))
    variants.append((f"{f} bf16", lambda s=s: s.bf16_one(0)))
for _, fn in variants:  # compile and warm
    fn()
    fn()
torch.cuda.synchronize()
for name, _ in variants:
    print(name, flush=True)
torch.cuda.cudart().cudaProfilerStart()
for _, fn in variants:
    fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
