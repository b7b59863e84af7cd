# A/B on one card: base (main 9bcd5d6) against the candidate tree (row terms early + block scales before the
# wait), and the candidate with TOKENSPEED_FP8_GEMV_PER_FORM=1; gemv_stack both scale kinds; GPU tests last.
step gs_base_ch 60 _ab_base python3 benchmarks/gemv_stack.py --skip-shapes --per-channel --out $R/gs_base_ch.json
step gs_cand_ch 60 . python3 benchmarks/gemv_stack.py --skip-shapes --per-channel --out $R/gs_cand_ch.json
step gs_base_blk 60 _ab_base python3 benchmarks/gemv_stack.py --skip-shapes --out $R/gs_base_blk.json
step gs_cand_blk 60 . python3 benchmarks/gemv_stack.py --skip-shapes --out $R/gs_cand_blk.json
for i in 1 2 3; do
step base$i 80 _ab_base python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/base$i.json
step cand$i 80 . python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/cand$i.json
step form$i 80 . TOKENSPEED_FP8_GEMV_PER_FORM=1 python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/form$i.json
done
step tests 150 . python3 -m pytest -m gpu -q -x tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "(gemv or fused or online or checkpoint or graph) and not presets"
step gs_cand_ch_sweep 90 . python3 benchmarks/gemv_stack.py --per-channel --out $R/gs_cand_ch_sweep.json
