E="python3 benchmarks/fp8_e2e.py --sections llama --profile"
step base_1 90 . $E --out $R/base_1.json
step attn_1 90 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_1.json
step both_1 90 . TOKENSPEED_ATTN_EARLY=1 TOKENSPEED_FP8_GEMV_L2_AHEAD=2 $E --out $R/both_1.json
step both_2 90 . TOKENSPEED_ATTN_EARLY=1 TOKENSPEED_FP8_GEMV_L2_AHEAD=2 $E --out $R/both_2.json
step attn_2 90 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_2.json
step base_2 90 . $E --out $R/base_2.json
step tests 130 . TOKENSPEED_ATTN_EARLY=1 TOKENSPEED_FP8_GEMV_L2_AHEAD=2 python3 -m pytest -m gpu -q -x tests/test_kernels_triton_gpu.py tests/test_kernels_fp8_gpu.py -k "decode or rope or gemv"
