# FP8 decode at 2 and 4 rows: the fused decode forms through the one-token GEMV (a program per row block and
# token, a row block's tokens side by side) for up to F rows (TOKENSPEED_FP8_FUSED_DECODE_TOKENS=F), against
# F=1 (2-16 rows through the skinny GEMM with separate norm and activation kernels); Llama-3.1-8B FP8,
# context 1024, alternating fresh processes. Then the GPU tests of the GEMV's fused forms and of the engine.
B="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,4"
step f1_a 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=1 $B --out $R/f1_a.json
step f2_a 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=2 $B --out $R/f2_a.json
step f4_a 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=4 $B --out $R/f4_a.json
step f4_b 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=4 $B --out $R/f4_b.json
step f2_b 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=2 $B --out $R/f2_b.json
step f1_b 60 . TOKENSPEED_FP8_FUSED_DECODE_TOKENS=1 $B --out $R/f1_b.json
step tests 240 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "fused_decode_forms or every_gemv or gemv_and_gemm or fast_kernels_and_references"
