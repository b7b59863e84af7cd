# (1) the new GPU test of to_f16_saturated; (2) main (satfinite kept) with o_proj's skinny launch at 8 K splits
# from a table (o8) against the launch tuner's picks (tun), Llama-3.1-8B FP8 at 2 / 16 rows, alternating.
step test_conv 70 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_gpu.py -k "activation_conversion"
L="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
step tun_1 80 . TOKENSPEED_FP8_GEMV_SHAPES=none $L --out $R/tun_1.json
step o8_1 60 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/o8.json $L --out $R/o8_1.json
step o8_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=$PWD/o8.json $L --out $R/o8_2.json
step tun_2 60 . TOKENSPEED_FP8_GEMV_SHAPES=none $L --out $R/tun_2.json
