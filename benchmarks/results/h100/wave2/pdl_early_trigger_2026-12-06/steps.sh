step tests 120 . TOKENSPEED_PDL_EARLY_TRIGGER=2 python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_gemm_gpu.py tests/test_kernels_triton_gpu.py -k "pdl or rope_write or graph"
E2E="python3 benchmarks/fp8_e2e.py --profile --sections llama"
step e0 75 . TOKENSPEED_PDL_EARLY_TRIGGER=0 $E2E --out $R/e0.json
step e1 60 . TOKENSPEED_PDL_EARLY_TRIGGER=1 $E2E --out $R/e1.json
step e2 60 . TOKENSPEED_PDL_EARLY_TRIGGER=2 $E2E --out $R/e2.json
step e0b 60 . TOKENSPEED_PDL_EARLY_TRIGGER=0 $E2E --out $R/e0b.json
step e2b 60 . TOKENSPEED_PDL_EARLY_TRIGGER=2 $E2E --out $R/e2b.json
step e1b 60 . TOKENSPEED_PDL_EARLY_TRIGGER=1 $E2E --out $R/e1b.json
