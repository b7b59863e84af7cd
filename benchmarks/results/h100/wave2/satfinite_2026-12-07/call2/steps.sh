# satfinite candidate (cand, the tree) against HEAD (_ab_base, base): its GPU tests with time to compile, then one more pair.
step tests 380 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py -k "skinny or decode_sizes or experts or graph or fast_kernels"
B="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
step base_3 60 _ab_base $B --out $R/base_3.json
step cand_3 60 . $B --out $R/cand_3.json
