step tests 150 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k skinny
E2E="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_cand 80 . $E2E --out $R/kv_cand.json
step kv_base 80 _ab_base $E2E --out $R/kv_base.json
step kv_cand2 80 . $E2E --out $R/kv_cand2.json
step kv_base2 80 _ab_base $E2E --out $R/kv_base2.json
