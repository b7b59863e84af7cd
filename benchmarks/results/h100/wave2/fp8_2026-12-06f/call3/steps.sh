E2E="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_cand 100 . $E2E --out $R/kv_cand.json
step kv_base 100 _ab_base $E2E --out $R/kv_base.json
step kv_cand2 100 . $E2E --out $R/kv_cand2.json
step stack 170 . python3 benchmarks/fp8_skinny_stack.py --tokens 4,16 --out $R/skinny_stack.json
step tests 60 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_fp8_gpu.py -k skinny
