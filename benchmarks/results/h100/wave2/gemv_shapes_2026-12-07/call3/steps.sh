step gemv_blk 70 . python3 benchmarks/gemv_stack.py --write-shapes $R/shapes_blocks.json --out $R/gemv_stack_blocks.json
step fp8_tests 260 . python3 -m pytest -m gpu -q -x tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py tests/test_kernels_fp8_kv_gpu.py
