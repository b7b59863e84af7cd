step tests 260 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "skinny or online or qkv_rope"
E2E="python3 benchmarks/fp8_e2e.py --profile --sections llama"
step bs1_cand 60 . $E2E --out $R/bs1_cand.json
step bs1_base 60 _ab_base $E2E --out $R/bs1_base.json
step bs1_norope 60 . TOKENSPEED_FP8_QKV_ROPE=0 $E2E --out $R/bs1_norope.json
step bs1_cand2 60 . $E2E --out $R/bs1_cand2.json
step bs1_base2 60 _ab_base $E2E --out $R/bs1_base2.json
