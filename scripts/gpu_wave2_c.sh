#!/usr/bin/env bash
# Device run C of wave 2 (one call, ~400 s): the FP8 / KV-tier / comm GPU tests (with their reports), then
# issue 13's KV-tier benchmark on the Qwen3-8B preset, LRU only beside host tier + retention (TURNS, BUDGET).
# The benchmark's folder comes back as one tarball ($OUT keeps at most 8 files). Carry .whl_gpu.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENSPEED_GPU_REPORT=$OUT/gpu_report.jsonl
T0=$(date +%s)
timeout ${TESTS_S:-130} python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_comm_gpu.py \
  tests/test_fp8_gpu.py tests/test_kv_tiers_gpu.py -k "not presets" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
timeout $(( ${BUDGET:-250} + 40 )) python3 benchmarks/kv_tiers.py --preset h200 --configs lru,host+retention \
  --turns ${TURNS:-10} --budget-s ${BUDGET:-250} --output-dir /tmp/kv_tiers > $OUT/kv_tiers.log 2>&1
echo "kv_tiers rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
rm -rf /tmp/kv_tiers/model; cp /tmp/kv_tiers/kv_tiers.json $OUT/ ; tar czf $OUT/kv_tiers_runs.tgz -C /tmp kv_tiers
cat $OUT/summary.txt; tail -3 $OUT/gpu_tests.log
