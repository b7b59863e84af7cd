# base = main at 7f5f55c; . = gate/up per-channel at 4 x 4096. On an H200 also issue 16's figures (base).
step gs_base_ch 60 _ab_base python3 benchmarks/gemv_stack.py --skip-shapes --per-channel --out $R/gs_base_ch.json
step gs_cand_ch 60 . python3 benchmarks/gemv_stack.py --skip-shapes --per-channel --out $R/gs_cand_ch.json
for i in 1 2 3; do
step base$i 80 _ab_base python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/base$i.json
step cand$i 80 . python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/cand$i.json
done
if grep -q H200 "$R/summary.txt"; then
step accept_e2e 240 _ab_base python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
step accept_kernels 120 _ab_base python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
step gs_cand_ch_sweep 90 . python3 benchmarks/gemv_stack.py --per-channel --out $R/gs_cand_ch_sweep.json
else
step gs_cand_ch_sweep 90 . python3 benchmarks/gemv_stack.py --per-channel --out $R/gs_cand_ch_sweep.json
step tests 200 . python3 -m pytest -m gpu -q -x tests/test_kernels_fp8_gpu.py -k "gemv or fused"
fi
