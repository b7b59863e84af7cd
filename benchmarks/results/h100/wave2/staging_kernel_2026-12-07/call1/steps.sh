# H200: issue 16's acceptance set on main (_ab_base), then Llama FP8 bs1 with the staging kernel (tree).
# H100: Llama FP8 bs1, main against the tree alternating, and the GPU tests the staging kernel touches.
E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
if grep -q H200 "$R/summary.txt"; then
  step accept_e2e 290 _ab_base python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step accept_kernels 170 _ab_base python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
  step cand_1 60 . $E --out $R/cand_1.json
  step base_1 60 _ab_base $E --out $R/base_1.json
else
  step base_1 60 _ab_base $E --out $R/base_1.json
  step cand_1 60 . $E --out $R/cand_1.json
  step cand_2 60 . $E --out $R/cand_2.json
  step base_2 60 _ab_base $E --out $R/base_2.json
  step tests 280 . python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_page_tables.py tests/test_gpu_generation.py tests/test_spec_gpu.py tests/test_kernels_triton_gpu.py -k "staging or step_inputs or device_copy or graph or overlap or drafter or spec or greedy"
fi
