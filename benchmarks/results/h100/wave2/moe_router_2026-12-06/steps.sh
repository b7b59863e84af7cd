step tests 150 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_moe_gpu.py tests/test_fp8_gpu.py -k "router_logits or pair_sum"
E2E="python3 benchmarks/fp8_e2e.py --profile --sections qwen3_moe"
step cand 100 . $E2E --out $R/cand.json
step base 100 _ab_base $E2E --out $R/base.json
step cand2 100 . $E2E --out $R/cand2.json
