"""Mixture-of-experts kernels: routing (`moe.route`) and the routed experts (`moe.experts`).

`moe.route` turns router logits into per-token expert ids and weights
(softmax/sigmoid scoring, optional group limiting and correction bias, as
Qwen3-MoE, Mixtral, DeepSeek-V2/V3 and Moonlight route):
`routing_reference.route_reference` (REFERENCE, the oracle, checked against
transformers) and `routing_triton.route_triton` (PORTABLE, one launch).

`moe.experts` applies the chosen SwiGLU experts and sums them with the routing
weights: `experts_reference.fused_experts_reference` (REFERENCE),
`experts_triton.fused_experts_triton` (PERFORMANT: expert-sorted grouped GEMMs
with the activation fused; measured fastest at every batch size on the H200) and
`experts_grouped_mm.fused_experts_grouped_mm` (PORTABLE, torch's CUTLASS grouped
GEMM, eligible from `GROUPED_MM_MIN_TOKENS` tokens when the caller states
`workload={"num_tokens": ...}`; chosen by override or where Triton is missing).
`experts_dispatch.select_experts_by_batch` resolves both sides of that
crossover once and picks per batch. `align` / `align_triton` sort (token, k)
pairs by expert for the fast kernels; `compile_configs` lists the Triton
kernels for `tokenspeed.kernels.compile_check`.

`moe.router_logits` computes the router's fp32 logits: `routing_reference.router_logits_reference`
(REFERENCE, `F.linear` on x widened to fp32) and `router_logits_triton` (PORTABLE, one launch, up to
`ROUTER_TRITON_MAX_TOKENS` tokens; kept here, free of triton, for the layers).

`moe.experts_fp8` is the same op with fp8 expert weights and block scales:
`experts_fp8_reference` (REFERENCE: dequantises the experts used) and
`experts_fp8_triton` (PERFORMANT: the Triton kernels with fp8 weights).
"""

# Tokens `moe.router_logits`'s Triton kernel serves; larger batches keep cuBLAS (`layers/moe.Router`).
# Measured on an H100 at Qwen3-30B-A3B's router: 2.5 against 6.8 us a layer at 1 token, 11.1 against 9.6
# at 64 (cuBLAS and the cast of x); the two cross near 45 tokens if both grow linearly, so 16 keeps a margin.
ROUTER_TRITON_MAX_TOKENS = 16
