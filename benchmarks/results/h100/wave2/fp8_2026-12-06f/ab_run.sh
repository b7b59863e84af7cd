#!/usr/bin/env bash
# Same-call A/B: the working tree (candidate) against _base/ (main). Steps: "name limit dir [ENV=..] cmd..."
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
R=$OUT/ab; mkdir -p $R; T0=$(date +%s); ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/summary.txt
step() {
  local name=$1 limit=$2 dir=$3; shift 3
  (cd $ROOT/$dir && PYTHONPATH=/tmp/site:$ROOT/$dir TOKENSPEED_GPU_REPORT=$R/$name.report.jsonl timeout $limit env "$@") > $R/$name.log 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))" >> $R/summary.txt
}
E2E="python3 benchmarks/fp8_e2e.py --profile"
NR=TOKENSPEED_KERNEL_ATTENTION_DECODE_ROPE=reference
step kv_norope 110 . $NR $E2E --sections kv_long --out $R/kv_norope.json
step llama_norope2 60 . $NR $E2E --sections llama --out $R/llama_norope2.json
step llama_cand2 60 . $E2E --sections llama --out $R/llama_cand2.json
step tests ${TESTS_S:-240} . python3 -m pytest -q -m gpu -rf -p no:cacheprovider --durations=15 tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py tests/test_kernels_triton_gpu.py -k "skinny or decode_rope"
tar czf $OUT/ab.tgz -C $OUT ab
cat $R/summary.txt; tail -3 $R/tests.log; grep -h "TPOT" $R/*.log
