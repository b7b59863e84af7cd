# satfinite fp16 conversion in to_f16_saturated (a183b42, the tree: cand) against HEAD without it (_ab_base: base):
# the GPU tests of the kernels that use it and the engine, then Llama-3.1-8B FP8 at 2 / 16 rows and Qwen3-30B-A3B FP8
# decode, alternating fresh processes.
step tests 200 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "skinny or decode_sizes or experts or graph or fast_kernels"
B="python3 benchmarks/fp8_e2e.py --sections llama_batch,qwen3_moe --batches 2,16"
step cand_1 90 . $B --out $R/cand_1.json
step base_1 90 _ab_base $B --out $R/base_1.json
step base_2 90 _ab_base $B --out $R/base_2.json
step cand_2 90 . $B --out $R/cand_2.json
