# Llama-3.1-8B FP8 bs1: main (_ab_base) against the tree (the staging kernel), alternating, three pairs more.
E="python3 benchmarks/fp8_e2e.py --sections llama --profile --repeats 5"
step cand_3 45 . $E --out $R/cand_3.json
step base_3 45 _ab_base $E --out $R/base_3.json
step base_4 45 _ab_base $E --out $R/base_4.json
step cand_4 45 . $E --out $R/cand_4.json
step cand_5 45 . $E --out $R/cand_5.json
step base_5 45 _ab_base $E --out $R/base_5.json
