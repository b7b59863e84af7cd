# greedy draw: the Triton argmax (tri, the default) against torch's two-stage reduction (ref), Llama-3.1-8B
# FP8 and bf16 bs1, alternating fresh processes.
E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
A=TOKENSPEED_KERNEL_SAMPLING_ARGMAX=reference
step ref_1 70 . $A $E --out $R/ref_1.json
step tri_1 60 . $E --out $R/tri_1.json
step tri_2 60 . $E --out $R/tri_2.json
step ref_2 60 . $A $E --out $R/ref_2.json
