"""GEMM kernels for decode-sized batches (a few tokens against a whole weight matrix).

`DECODE_MAX_TOKENS` lives here, free of any triton import, because layers
state it as the registry workload `num_tokens` when they pick a decode kernel.

It is 1: on the H200 the one-token GEMV (register reduction) beats cuBLAS
with its fused epilogues, but the tensor-core path for 2-8 tokens did not
(benchmarks/gemv_bench.py, 8 tokens: qkv 22.4 us vs cuBLAS 16.2, gate_up 78.6
vs 58.5), so those batches keep cuBLAS. The kernels compute any token count
correctly (the tests cover up to 8); raising this is the switch once a
multi-token path wins.

`FP8_GEMV_MAX_TOKENS` is the same kind of bound for the FP8 weights of
`gemm.fp8`, and also 1: at 4 and 16 tokens the first FP8 GEMV (a tensor-core
path dequantising weights in registers) ran at 0.2 of the copy bandwidth,
slower than the block-scaled FP8 GEMM (`fp8_kernels.py`, H200, 2026-12-02:
qkv at 16 tokens 41 us against 25 us), so batches of two or more tokens
take the GEMM.
"""

# Token counts the decode GEMV serves; beyond this cuBLAS's tiled GEMMs win.
DECODE_MAX_TOKENS = 1

# Token counts the FP8 weight-streaming GEMV (`gemm.fp8` name "triton_gemv") serves; above
# it the block-scaled FP8 tensor-core GEMMs do (see `gemm/fp8_dispatch.py`).
FP8_GEMV_MAX_TOKENS = 1
