# Any GPU: DeepSeek's tokens with the LM head through the decode GEMV (769e86d, first GPU run).
step tests_deepseek 170 . python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_deepseek_gpu.py
if grep -q H200 "$R/summary.txt"; then
  # H200: the per-channel GEMV sweep with the TMA shapes, its table against the shipped one end to end.
  GPU=$(python3 -c "import torch,sys; sys.path.insert(0,'.'); from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_file_name; print(gpu_file_name(torch.cuda.get_device_name()))")
  cp tokenspeed/kernels/gemm/fp8_gemv_shapes/$GPU $R/new.json; cp $R/new.json $R/shipped.json
  step sweep_pc 120 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $R/new.json --out $R/gemv_stack_pc.json
  E="python3 benchmarks/fp8_e2e.py --sections llama --repeats 5"
  step new_1 45 . TOKENSPEED_FP8_GEMV_SHAPES=$R/new.json $E --out $R/new_1.json
  step ship_1 45 . $E --out $R/ship_1.json
  step ship_2 45 . $E --out $R/ship_2.json
  step new_2 45 . TOKENSPEED_FP8_GEMV_SHAPES=$R/new.json $E --out $R/new_2.json
else
  step tests_fused_tma 280 . python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fp8_gpu.py -k "fused or tma"
fi
