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
`gemm.fp8`: 16. One token takes the weight-streaming GEMV, 2-16 the skinny
tensor-core GEMM (`fp8_skinny_triton.py`, built like the fp8 decode
attention's loop; a first tensor-core GEMV of 2026-12-02 had run at 0.2 of
the copy bandwidth, before that loop's lessons), more the block-scaled FP8
GEMMs. `FP8_FUSED_DECODE_MAX_TOKENS` bounds the decode layer's fused forms
(RMSNorm prologue, SiLU-and-mul, residual), which only the one-token kernel has
(the skinny GEMM's, measured 28-31% slower on an H100, were removed).
"""

# Token counts the decode GEMV serves; beyond this cuBLAS's tiled GEMMs win.
DECODE_MAX_TOKENS = 1

# Token counts the FP8 weight-streaming GEMV (`gemm.fp8` name "triton_gemv") serves; above
# it the block-scaled FP8 tensor-core GEMMs do (see `gemm/fp8_dispatch.py`).
FP8_GEMV_MAX_TOKENS = 16
# Token counts of the decode layer's fused FP8 forms (norm prologue, SiLU-and-mul, residual): the one-token kernel's.
FP8_FUSED_DECODE_MAX_TOKENS = 1
