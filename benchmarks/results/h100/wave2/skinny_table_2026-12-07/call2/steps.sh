S=$ROOT/shapes_h100.json
L="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
step tab_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $L --out $R/tab_3.json
step base_3 60 . $L --out $R/base_3.json
step tab_4 60 . TOKENSPEED_FP8_GEMV_SHAPES=$S $L --out $R/tab_4.json
