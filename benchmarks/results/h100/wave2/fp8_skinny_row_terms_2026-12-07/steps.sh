# base = 468bfb8 (with this tree's benchmark scripts); . = the skinny GEMM's per-row terms before the PDL wait.
for i in 1 2; do
step sk_base$i 100 _ab_base python3 benchmarks/fp8_skinny_stack.py --per-channel --skip-shapes --tokens 4,16 --out $R/sk_base$i.json
step sk_cand$i 100 . python3 benchmarks/fp8_skinny_stack.py --per-channel --skip-shapes --tokens 4,16 --out $R/sk_cand$i.json
done
step tests 150 . python3 -m pytest -m gpu -q -x tests/test_kernels_fp8_gpu.py -k "skinny or dispatch or decode_sizes"
