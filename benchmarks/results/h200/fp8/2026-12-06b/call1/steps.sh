step accept_e2e 300 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
step accept_kernels 150 . python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
step gemv_stack 120 . python3 benchmarks/gemv_stack.py --out $R/gemv_stack.json
