# Any GPU: the spec graphs on/off test that failed on main before 73ff27e (first GPU run of the fix).
# H200: issue 16's acceptance set at main, the decode attention kernel, the per-channel GEMV sweep (writes a shapes table).
step spec_graphs 150 . python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_spec_gpu.py -k graphs_on_off
if grep -q H200 "$R/summary.txt"; then
  step accept_e2e 290 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step accept_attention 60 . python3 benchmarks/fp8_kernels.py --sections decode_attention --out $R/accept_attention.json
  step gemv_pc 150 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $R/shapes_pc.json --out $R/gemv_stack_pc.json
fi
