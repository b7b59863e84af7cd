# the attention kernels' GPU tests on the satfinite tree (the previous call's ran out of time compiling)
step tests_kv 330 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_kv_gpu.py tests/test_kernels_mla_gpu.py tests/test_kernels_triton_gpu.py -k "fp8 or mla or extend or decode"
