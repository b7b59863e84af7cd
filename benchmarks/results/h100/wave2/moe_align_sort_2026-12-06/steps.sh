step tests 90 . python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_moe_gpu.py -k "align or experts"
E2E="python3 benchmarks/fp8_e2e.py --sections qwen3_moe"
step e2e_sort 70 . $E2E --profile --out $R/e2e_sort.json
step e2e_base 70 _ab_base $E2E --profile --out $R/e2e_base.json
step e2e_sort2 50 . $E2E --profile --out $R/e2e_sort2.json
step e2e_base2 50 _ab_base $E2E --profile --out $R/e2e_base2.json
MK="python3 benchmarks/moe_kernels.py --shapes qwen3_30b_a3b --tokens 1,64,128,256,512"
step kernels_sort 90 . $MK --out $R/moe_kernels_sort.json
step kernels_base 90 _ab_base $MK --out $R/moe_kernels_base.json
