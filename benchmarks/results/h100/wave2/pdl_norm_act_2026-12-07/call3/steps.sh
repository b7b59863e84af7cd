step tests 55 . python3 -m pytest -m gpu -q -rf tests/test_kernels_gemm_gpu.py -k "pdl"
