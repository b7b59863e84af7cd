step moe 200 . python3 benchmarks/fp8_e2e.py --sections qwen3_moe --profile --out $R/moe.json
