step tests 200 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_decode_merge_gpu.py tests/test_kernels_triton_gpu.py tests/test_kernels_fp8_kv_gpu.py tests/test_kernels_mla_gpu.py -k "decode or merge or mla"
step kern_cand 120 . python3 benchmarks/fp8_kernels.py --out $R/kern_cand.json
step kern_base 120 _ab_base python3 benchmarks/fp8_kernels.py --out $R/kern_base.json
E2E="python3 benchmarks/fp8_e2e.py --profile --sections llama,kv_long"
step e2e_cand 150 . $E2E --out $R/e2e_cand.json
step e2e_base 150 _ab_base $E2E --out $R/e2e_base.json
