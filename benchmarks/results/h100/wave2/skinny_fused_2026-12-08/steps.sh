# Any GPU: the skinny GEMM's fused decode forms (TOKENSPEED_FP8_SKINNY_FUSED) at 4 and 16 rows beside the default, twice.
step batch_1 80 . python3 benchmarks/fp8_e2e.py --sections llama_batch --repeats 3 --out $R/batch_1.json
step batch_2 80 . python3 benchmarks/fp8_e2e.py --sections llama_batch --repeats 3 --out $R/batch_2.json
