if grep -q H200 "$R/summary.txt"; then
  # issue 16's acceptance set on the tree, then the one-token GEMV's shape sweep in a decode graph
  step accept_e2e 220 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step accept_kernels 170 . python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
  step gemv_pc 100 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $R/shapes.json --out $R/gemv_stack_per_channel.json
else
  # the skinny FP8 GEMM's GPU tests (two-warp shapes), its sweep at 2 / 16 rows, then Llama FP8 at 2 / 16 rows
  # with the sweep's table (tab) against the shipped table (base), alternating
  step skinny_tests 150 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py -k skinny
  S=$R/shapes.json
  step sweep 120 . python3 benchmarks/fp8_skinny_stack.py --per-channel --tokens 2,16 --write-shapes $S --out $R/skinny_stack.json
  L="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
  step base_1 70 . $L --out $R/base_1.json
  step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $L --out $R/tab_1.json
  step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $L --out $R/tab_2.json
  step base_2 60 . $L --out $R/base_2.json
fi
