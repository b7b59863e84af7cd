E2E="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_cand 70 . $E2E --out $R/kv_cand.json
step kv_base 70 _ab_base $E2E --out $R/kv_base.json
step kv_unfused 70 . TOKENSPEED_FP8_SKINNY_FUSED=0 $E2E --out $R/kv_unfused.json
step kv_cand2 70 . $E2E --out $R/kv_cand2.json
step kv_base2 70 _ab_base $E2E --out $R/kv_base2.json
