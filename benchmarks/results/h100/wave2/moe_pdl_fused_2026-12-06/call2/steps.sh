E2E="python3 benchmarks/fp8_e2e.py --profile --sections qwen3_moe"
step moe_fused 100 _ab_base/fused $E2E --out $R/moe_fused.json
step moe_both2 100 . $E2E --out $R/moe_both2.json
step moe_base2 100 _ab_base $E2E --out $R/moe_base2.json
E2E="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_both 100 . $E2E --out $R/kv_both.json
step kv_base 100 _ab_base $E2E --out $R/kv_base.json
