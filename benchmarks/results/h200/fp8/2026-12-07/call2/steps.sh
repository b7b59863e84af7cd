E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
step skinny 150 . python3 benchmarks/fp8_skinny_stack.py --per-channel --tokens 4,16 --write-shapes $R/shapes_skinny.json --out $R/skinny.json
step table_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_pc.json $E --out $R/table_1.json
step none_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/none_1.json
step none_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/none_2.json
step table_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_pc.json $E --out $R/table_2.json
step table_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/shapes_pc.json $E --out $R/table_3.json
step none_3 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $E --out $R/none_3.json
