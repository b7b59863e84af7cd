step gemv_blocks 120 . python3 benchmarks/gemv_stack.py --write-shapes $R/shapes_blocks.json --out $R/gemv_stack_blocks.json
step fp8_tests 300 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_pc.json python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py
