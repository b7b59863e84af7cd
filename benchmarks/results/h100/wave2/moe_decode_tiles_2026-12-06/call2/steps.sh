E2E="python3 benchmarks/fp8_e2e.py --sections qwen3_moe"
step e2e_base_a 70 _ab_base $E2E --out $R/e2e_base_a.json
step e2e_fixed_a 70 _ab_base/cand $E2E --out $R/e2e_fixed_a.json
step e2e_base_b 70 _ab_base $E2E --out $R/e2e_base_b.json
step e2e_fixed_b 70 _ab_base/cand $E2E --out $R/e2e_fixed_b.json
