"""One call of the FP8 MoE experts op per case, for Nsight Compute (warm-ups outside the profiled range).

    ncu --clock-control none --profile-from-start off -k regex:_moe_ --set full -o moe python3 <this file>
Cases: Qwen3-30B-A3B's experts (hidden 2048, intermediate 768, 128 experts, top-8), FP8 weights with
128 x 128 block scales, 1 and 64 tokens at the decode tiles the launch tuner picks (warm-ups run the tuner),
then the same experts in bf16; the profile covers `_moe_gate_up_kernel` and `_moe_down_kernel` of each.
"""

import torch

from tokenspeed.kernels.moe.experts_fp8_triton import fused_experts_fp8_triton, tuned_decode_tiles
from tokenspeed.kernels.moe.experts_triton import fused_experts_triton
from tokenspeed.kernels.quant.fp8 import dequantize_weight, quantize_weight_block

HIDDEN, INTER, EXPERTS, TOP_K, BLOCK = 2048, 768, 128, 8, (128, 128)
gen = torch.Generator(device="cuda").manual_seed(1)
w13, s13 = quantize_weight_block(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5, BLOCK)
w2, s2 = quantize_weight_block(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") * INTER**-0.5, BLOCK)
w13_bf16 = dequantize_weight(w13, s13, BLOCK, torch.bfloat16)
w2_bf16 = dequantize_weight(w2, s2, BLOCK, torch.bfloat16)
calls = []
for tokens in (1, 64):
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
    weights = torch.randn(tokens, TOP_K, generator=gen, device="cuda").softmax(dim=-1)
    calls.append(lambda x=x, ids=ids, w=weights: fused_experts_fp8_triton(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2))
    calls.append(lambda x=x, ids=ids, w=weights: fused_experts_triton(x, w13_bf16, w2_bf16, w, ids))
for call in calls:
    call()
    call()
torch.cuda.synchronize()
print({repr(k): repr(v.config) for k, v in tuned_decode_tiles().items()})
torch.cuda.profiler.start()
for call in calls:
    call()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
