#!/usr/bin/env bash
# Device run C of wave 2 (one call): the comm / FP8 / KV-tier GPU tests (with their reports), the MLA and
# GQA verify kernels' selection and times at q_len 1-5 (issue 15), then issue 13's KV-tier benchmark on the
# Qwen3-8B preset: the pinned-copy bandwidth section, and the configurations in KV_CONFIGS (default LRU
# only beside host tier + retention; "none": bandwidth only) within BUDGET seconds, TURNS turns a session.
# The benchmark's folder comes back as one tarball ($OUT keeps at most 8 files). Carry .whl_gpu.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENSPEED_GPU_REPORT=$OUT/gpu_report.jsonl
T0=$(date +%s)
timeout ${TESTS_S:-130} python3 -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kernels_comm_gpu.py \
  tests/test_kv_tiers_gpu.py tests/test_fp8_gpu.py -k "not presets" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
timeout 90 python3 benchmarks/spec_decode.py --sections kernels --out $OUT/spec_kernels.json > $OUT/spec_kernels.log 2>&1
echo "spec kernels rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
timeout $(( ${BUDGET:-250} + 60 )) python3 benchmarks/kv_tiers.py --preset h200 --configs ${KV_CONFIGS:-lru,host+retention} \
  --turns ${TURNS:-10} --budget-s ${BUDGET:-250} --output-dir /tmp/kv_tiers > $OUT/kv_tiers.log 2>&1
echo "kv_tiers rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
rm -rf /tmp/kv_tiers/model; cp /tmp/kv_tiers/kv_tiers.json $OUT/; tar czf $OUT/kv_tiers_runs.tgz -C /tmp kv_tiers
cat $OUT/summary.txt; tail -3 $OUT/gpu_tests.log
