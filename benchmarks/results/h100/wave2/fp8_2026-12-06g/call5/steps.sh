step sweep 150 . python3 benchmarks/results/h100/wave2/fp8_2026-12-06g/call5/fp8_decode_register_sweep.py $R/register_sweep.json
E2E="python3 benchmarks/fp8_e2e.py --profile --sections kv_long"
step kv_cand 100 . $E2E --out $R/kv_cand.json
step kv_base 100 _ab_base $E2E --out $R/kv_base.json
