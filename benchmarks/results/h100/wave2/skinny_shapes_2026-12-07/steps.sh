# H200: the one-token FP8 GEMV's shape table swept in a decode step's graph, Llama-3.1-8B FP8 bs1 with the
# table (tab) and the built-in rules (base) alternating, then issue 16's figures with the table.
# H100: the skinny FP8 GEMM's shape table (per-channel weights, 4 and 16 tokens) swept in a decode step's
# graph, then Llama-3.1-8B FP8 at 4 and 16 rows with the table (tab) and with the launch tuner (base), alternating.
S=$R/shapes.json
if grep -q H200 "$R/summary.txt"; then
  E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
  step gemv_pc 110 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $S --out $R/gemv_stack_per_channel.json
  step base_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_1.json
  step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_1.json
  step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $E --out $R/tab_2.json
  step base_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/base_2.json
  step accept_e2e 200 . TOKENSPEED_FP8_GEMV_SHAPES=$S python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step accept_kernels 90 . python3 benchmarks/fp8_kernels.py --out $R/accept_kernels.json
else
  B="python3 benchmarks/fp8_e2e.py --sections llama_batch"
  step skinny_pc 200 . python3 benchmarks/fp8_skinny_stack.py --per-channel --tokens 4,16 --write-shapes $S --out $R/skinny_stack_per_channel.json
  step base_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $B --out $R/base_1.json
  step tab_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $B --out $R/tab_1.json
  step tab_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $B --out $R/tab_2.json
  step base_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $B --out $R/base_2.json
  step base_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $B --out $R/base_3.json
  step tab_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $B --out $R/tab_3.json
fi
