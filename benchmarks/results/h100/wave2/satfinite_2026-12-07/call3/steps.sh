# (1) the attention kernels that also convert their query with to_f16_saturated: GPU tests on the satfinite tree, and
# fp8_kernels.py (fp8 decode attention against copy) in it (cand) and in HEAD (_ab_base, base);
# (2) the late PDL trigger in RMSNorm / SiLU-and-mul (_ab_late = HEAD + ba80a5d) against HEAD (base), alternating.
step tests_kv 150 . python3 -m pytest -m gpu -q -rf tests/test_kernels_fp8_kv_gpu.py tests/test_kernels_mla_gpu.py tests/test_kernels_triton_gpu.py -k "fp8 or mla or extend or decode"
L="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
step late_1 60 _ab_late $L --out $R/late_1.json
step lbase_1 60 _ab_base $L --out $R/lbase_1.json
step lbase_2 60 _ab_base $L --out $R/lbase_2.json
step late_2 60 _ab_late $L --out $R/late_2.json
step kern_cand 150 . python3 benchmarks/fp8_kernels.py --out $R/kern_cand.json
step kern_base 150 _ab_base python3 benchmarks/fp8_kernels.py --out $R/kern_base.json
