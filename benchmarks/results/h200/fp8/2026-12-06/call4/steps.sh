step tests 380 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py tests/test_kernels_fp8_kv_gpu.py
