E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
step base_1 100 . $E --out $R/base_1.json
step attn_1 100 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_1.json
step attn_2 100 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_2.json
step base_2 100 . $E --out $R/base_2.json
if grep -q H200 "$R/summary.txt"; then  # the card: its acceptance set on main as committed
  step accept_e2e 240 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
  step gemv_stack 90 . python3 benchmarks/gemv_stack.py --per-channel --out $R/gemv_stack_per_channel.json
else
  step base_3 100 . $E --out $R/base_3.json
  step attn_3 100 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_3.json
  step tests 120 . TOKENSPEED_ATTN_EARLY=1 python3 -m pytest -m gpu -q -x tests/test_kernels_triton_gpu.py -k "cuda_graph or rope_write"
  step attn_4 100 . TOKENSPEED_ATTN_EARLY=1 $E --out $R/attn_4.json
  step base_4 100 . $E --out $R/base_4.json
fi
