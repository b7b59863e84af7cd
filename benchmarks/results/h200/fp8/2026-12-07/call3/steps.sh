step table_kv 90 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_all.json python3 benchmarks/fp8_e2e.py --sections kv_long,llama_batch --out $R/table_kv.json
step none_kv 90 . TOKENSPEED_FP8_GEMV_SHAPES=none python3 benchmarks/fp8_e2e.py --sections kv_long,llama_batch --out $R/none_kv.json
step none_kv2 90 . TOKENSPEED_FP8_GEMV_SHAPES=none python3 benchmarks/fp8_e2e.py --sections kv_long,llama_batch --out $R/none_kv2.json
step table_kv2 90 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_all.json python3 benchmarks/fp8_e2e.py --sections kv_long,llama_batch --out $R/table_kv2.json
