# New launch shapes (around the H200's per-channel picks): sweep them per channel into a copy of this GPU's shipped
# table, then Llama-3.1-8B FP8 bs1 with the shipped table against the new one, alternating.
GPU=$(python3 -c "import torch,sys; sys.path.insert(0,'.'); from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_file_name; print(gpu_file_name(torch.cuda.get_device_name()))")
cp tokenspeed/kernels/gemm/fp8_gemv_shapes/$GPU $R/new.json 2>/dev/null; echo "$GPU" >> $R/summary.txt
E="python3 benchmarks/fp8_e2e.py --sections llama --repeats 5"
step sweep_pc 110 . python3 benchmarks/gemv_stack.py --per-channel --write-shapes $R/new.json --out $R/gemv_stack_pc.json
step shipped_1 45 . $E --out $R/shipped_1.json
step new_1 45 . TOKENSPEED_FP8_GEMV_SHAPES=$R/new.json $E --out $R/new_1.json
step new_2 45 . TOKENSPEED_FP8_GEMV_SHAPES=$R/new.json $E --out $R/new_2.json
step shipped_2 45 . $E --out $R/shipped_2.json
