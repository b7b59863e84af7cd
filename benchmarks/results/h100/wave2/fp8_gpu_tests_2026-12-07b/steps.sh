# H200: the one-token FP8 GEMV's shape table swept in a decode step's graph, Llama-3.1-8B FP8 bs1 with the
# table (tab) and the built-in rules (base) alternating, then issue 16's figures with the table.
# H100: the FP8 GPU test set (the previous H100 call ran 86 of its 96 tests before its limit).
if grep -q H200 "$R/summary.txt"; then
  E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
  S=$R/shapes.json
  step gemv_pc 110 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $S --out $R/gemv_stack_per_channel.json
  step base_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_1.json
  step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_1.json
  step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_2.json
  step base_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_2.json
  step accept_e2e 200 . TOKENSPEED_FP8_GEMV_SHAPES=$S python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step accept_kernels 90 . python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
else
  step fp8_tests 540 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py tests/test_kernels_fp8_kv_gpu.py
fi
