# PDL for RMSNorm and SiLU-and-mul (the kernels FP8 decode layers run as their own at 2-16 rows): the tree (cand)
# against HEAD without it (_ab_base, base), Llama-3.1-8B FP8 and bf16 at 2, 4 and 16 rows, alternating fresh
# processes; then the GPU tests of PDL on and off.
B="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,4,16"
step base_1 70 _ab_base $B --out $R/base_1.json
step cand_1 70 . $B --out $R/cand_1.json
step cand_2 70 . $B --out $R/cand_2.json
step base_2 70 _ab_base $B --out $R/base_2.json
step base_3 70 _ab_base $B --out $R/base_3.json
step cand_3 70 . $B --out $R/cand_3.json
step tests 150 . python3 -m pytest -m gpu -q -rf tests/test_kernels_gemm_gpu.py tests/test_kernels_triton_gpu.py -k "pdl or graph"
