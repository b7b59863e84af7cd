# Issue 16's figures on main at fd33190 (the FP8 GEMV's epilogue terms early, gate/up per-channel at 4 x 4096).
step accept_e2e 260 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
step accept_kernels 130 . python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
step gs_ch_sweep 100 . python3 benchmarks/gemv_stack.py --per-channel --out $R/gs_ch_sweep.json
