# H200: the fp8 decode attention's figure (issue 16: >= 0.75 of copy), then the e2e acceptance set, on the tree.
# Both: test_spec_gpu and the engine tests, with eager verify steps in a graph's shape computing the LM head
# on every token, as the graph does.
T="python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_spec_gpu.py tests/test_gpu_generation.py -k"
if grep -q H200 "$R/summary.txt"; then
  step accept_attention 60 . python3 benchmarks/fp8_kernels.py --sections decode_attention --out $R/accept_attention.json
  step spec 150 . $T "graphs_on_off or fp32_identical"
  step accept_e2e 290 . python3 benchmarks/fp8_e2e.py --sections llama,qwen3_moe,kv_long --profile --out $R/accept_e2e.json
else
  step spec 280 . $T "spec or graphs or staging or identical"
fi
