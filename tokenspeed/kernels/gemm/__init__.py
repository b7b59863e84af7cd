"""GEMM kernels for decode-sized batches (a few tokens against a whole weight matrix).

`DECODE_MAX_TOKENS` lives here, free of any triton import, because layers
state it as the registry workload `num_tokens` when they pick a decode kernel.

It is 1: on the H200 the one-token GEMV (register reduction) beats cuBLAS
with its fused epilogues, but the tensor-core path for 2-8 tokens did not
(benchmarks/gemv_bench.py, 8 tokens: qkv 22.4 us vs cuBLAS 16.2, gate_up 78.6
vs 58.5), so those batches keep cuBLAS. The kernels compute any token count
correctly (the tests cover up to 8); raising this is the switch once a
multi-token path wins.

`FP8_GEMV_MAX_TOKENS` is the same kind of bound for the FP8 weights of `gemm.fp8`.
"""

# Token counts the decode GEMV serves; beyond this cuBLAS's tiled GEMMs win.
DECODE_MAX_TOKENS = 1

# Token counts the FP8 weight-streaming GEMV (`gemm.fp8` name "triton_gemv") serves; above
# it the block-scaled FP8 tensor-core GEMM does (see `gemm/fp8_dispatch.py`).
FP8_GEMV_MAX_TOKENS = 16
