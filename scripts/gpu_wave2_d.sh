#!/usr/bin/env bash
# Device run D of wave 2 (one call): the FP8 GPU tests (issue 16), the FP8 kernel benchmark against its
# ceilings (KERNELS_S seconds, 0 = skip), FP8 end to end (E2E_SECTIONS, default llama: bs1 FP8 vs bf16
# with a kernel table of the decode step per variant, `fp8_e2e.py --profile`), then parts
# of issue 13's KV-tier benchmark on the Qwen3-8B preset (KV_PARTS="CONFIGS:BUDGET ...", "": none; a
# later call merges more with KV_ARGS="--merge-from F"). Outputs: at most 8 files (tarballs). Carry .whl_gpu.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENSPEED_GPU_REPORT=$OUT/gpu_report.jsonl
T0=$(date +%s)
if [ "${TESTS_S:-110}" != 0 ]; then
  timeout ${TESTS_S:-110} python3 -m pytest -q -m gpu -rf -p no:cacheprovider ${TESTS:-tests/test_fp8_gpu.py} \
    -k "not presets" > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
fi
mkdir -p /tmp/fp8
if [ "${KERNELS_S:-0}" != 0 ]; then
  timeout $KERNELS_S python3 benchmarks/fp8_kernels.py --out /tmp/fp8/fp8_kernels.json > /tmp/fp8/fp8_kernels.log 2>&1
  echo "fp8 kernels rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
fi
if [ "${E2E_S:-90}" != 0 ]; then
  timeout ${E2E_S:-90} python3 benchmarks/fp8_e2e.py --sections ${E2E_SECTIONS:-llama} --profile --out /tmp/fp8/fp8_e2e.json \
    > /tmp/fp8/fp8_e2e.log 2>&1
  echo "fp8 e2e rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
fi
${EXTRA:-true} >> $OUT/summary.txt 2>&1
tar czf $OUT/fp8.tgz -C /tmp fp8
for part in ${KV_PARTS-lru:300}; do  # CONFIGS:BUDGET; each part merges into the same kv_tiers.json
  timeout $(( ${part#*:} + 40 )) python3 benchmarks/kv_tiers.py --preset h200 --configs ${part%%:*} \
    --budget-s ${part#*:} --output-dir /tmp/kv_tiers ${KV_ARGS:-} >> $OUT/kv_tiers.log 2>&1
  echo "kv_tiers $part rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
  rm -rf /tmp/kv_tiers/model; cp /tmp/kv_tiers/kv_tiers.json $OUT/; tar czf $OUT/kv_tiers_runs.tgz -C /tmp kv_tiers
done
cat $OUT/summary.txt; tail -3 $OUT/gpu_tests.log 2>/dev/null
