step tests2 450 . python3 -m pytest -m gpu -q -x tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "not presets"
