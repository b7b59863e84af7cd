# PDL for RMSNorm and SiLU-and-mul without the early trigger (they wait, their dependents launch as they end):
# the tree (cand) against HEAD (_ab_base, base), Llama-3.1-8B FP8 and bf16 at 2 and 16 rows, alternating.
B="python3 benchmarks/fp8_e2e.py --sections llama_batch --batches 2,16"
step cand_1 60 . $B --out $R/cand_1.json
step base_1 60 _ab_base $B --out $R/base_1.json
step base_2 60 _ab_base $B --out $R/base_2.json
step cand_2 60 . $B --out $R/cand_2.json
