GPU=$(python3 -c "import torch,sys; sys.path.insert(0,'.'); from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_file_name; print(gpu_file_name(torch.cuda.get_device_name()))")
cp tokenspeed/kernels/gemm/fp8_gemv_shapes/$GPU $R/new.json 2>/dev/null; echo "$GPU" >> $R/summary.txt
step sweep_pc 170 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $R/new.json --out $R/gemv_stack_pc.json
step tests 70 . python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fp8_gpu.py -k "tma"
