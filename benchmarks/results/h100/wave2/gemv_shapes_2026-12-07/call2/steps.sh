E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
S=$R/shapes.json
if grep -q H200 "$R/summary.txt"; then
  step gemv_pc 100 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $S --out $R/gemv_stack_per_channel.json
  step base_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_1.json
  step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_1.json
  step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_2.json
  step base_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_2.json
  step accept_e2e 200 . TOKENSPEED_FP8_GEMV_SHAPES=$S python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
else
  step llama_batch 150 . python3 benchmarks/fp8_e2e.py --sections llama_batch --out $R/llama_batch.json
  step fp8_kernels 120 . python3 benchmarks/fp8_kernels.py --out $R/fp8_kernels.json
fi
