# The one-token FP8 GEMV's per-GPU shape table: sweep it in a decode step's graph, then Llama-3.1-8B FP8 bs1
# with the table (tab) and with the built-in rules (base), alternating fresh processes.
E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
S=$R/shapes.json
step gemv_pc 100 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $S --out $R/gemv_stack_per_channel.json
step base_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_1.json
step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_1.json
step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_2.json
step base_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_2.json
if grep -q H200 "$R/summary.txt"; then
  step accept_e2e 200 . TOKENSPEED_FP8_GEMV_SHAPES=$S python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
else
  step tests 200 . python3 -m pytest -m gpu -q tests/test_kernels_triton_gpu.py tests/test_kernels_gemm_gpu.py tests/test_spec_gpu.py tests/test_gpu_generation.py -k "cuda_graph or rope_write or pdl_on_and_off or drafter_graphs or graphs_on_and_off or cuda_graphs_and_overlap"
fi
step base_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_3.json
step tab_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_3.json
