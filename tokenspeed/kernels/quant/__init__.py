"""FP8 quantisation (`quant` family): formats, references, and the Triton kernels that write fp8.

- `fp8`: the formats (e4m3, dynamic per-token-group activations, block /
  per-channel / per-tensor weight scales, static per-head KV-cache scales)
  and their torch reference: quantise, dequantise, check, online weight
  quantisation for `quantization="fp8"`. `quant.per_token_group` REFERENCE.
- `fp8_cast`: the e4m3 rounding every Triton writer uses (exact on the GPU
  and under the interpreter alike).
- `quantize_triton`: `quant.per_token_group` PORTABLE (cuda).
- `compile_configs`: the FP8 GEMM kernels for `tokenspeed.kernels.compile_check`.

The kernels that consume fp8 live with their op: `gemm.fp8` (`gemm/fp8_*`),
`moe.experts_fp8` (`moe/experts_fp8_*`), and the fp8 KV cache in
`attention`, `kvstore` and `mla` (keyword `k_scale`/`v_scale`, `kv_scale`).
"""
