step stack 200 _ab_base python3 benchmarks/moe_decode_stack.py --out $R/moe_decode_stack.json
E2E="python3 benchmarks/fp8_e2e.py --profile --sections qwen3_moe"
step e2e_fixed 100 _ab_base/cand $E2E --out $R/e2e_fixed.json
step e2e_base 100 _ab_base $E2E --out $R/e2e_base.json
step e2e_fixed2 100 _ab_base/cand $E2E --out $R/e2e_fixed2.json
