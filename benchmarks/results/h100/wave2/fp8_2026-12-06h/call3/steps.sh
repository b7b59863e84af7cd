step fp8_e2e 300 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/fp8_e2e.json
step fp8_kernels 200 . python3 benchmarks/fp8_kernels.py --out $R/fp8_kernels.json
