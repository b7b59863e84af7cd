# (1) GPU tests: every fp8 decode attention launch (page-list ones new) against the reference on long contexts,
# in a CUDA graph, and the Triton argmax (kernel, engine); (2) fp8_kernels.py: fp8 decode attention at 32 and
# 4 rows x 32K, each launch; (3) the 4 x 32K decode step, fp8 launch tuned on long rows among seven (cand, the
# tree) against HEAD (base: tuned on the graph probe's one-position rows among four), alternating.
step tests 190 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_kv_gpu.py tests/test_kernels_triton_gpu.py tests/test_gpu_generation.py -k "fp8_long_contexts or fp8_decode_step_replays or argmax or greedy_draw"
step kern 150 . python3 benchmarks/fp8_kernels.py --sections decode_attention --out $R/kern.json
K="python3 benchmarks/fp8_e2e.py --sections kv_long --profile"
step kv_base_1 70 _ab_base $K --out $R/kv_base_1.json
step kv_cand_1 60 . $K --out $R/kv_cand_1.json
step kv_cand_2 60 . $K --out $R/kv_cand_2.json
step kv_base_2 60 _ab_base $K --out $R/kv_base_2.json
