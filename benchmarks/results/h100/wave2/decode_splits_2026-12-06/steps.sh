step tests 45 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_triton_gpu.py -k "decode"
KV="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_cand 55 . $KV --out $R/kv_cand.json
step kv_base 55 _ab_base $KV --out $R/kv_base.json
step kv_cand2 50 . $KV --out $R/kv_cand2.json
step kv_base2 50 _ab_base $KV --out $R/kv_base2.json
