step tests 240 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_fp8_gpu.py tests/test_kernels_moe_gpu.py tests/test_kernels_gemm_gpu.py -k "pdl or router_logits or pair_sum or gemv_on_and_off"
E2E="python3 benchmarks/fp8_e2e.py --profile --sections qwen3_moe"
step moe_both 100 . $E2E --out $R/moe_both.json
step moe_base 100 _ab_base $E2E --out $R/moe_base.json
