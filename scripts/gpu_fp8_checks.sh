#!/usr/bin/env bash
# One device run for issue 16 (and the KV-tier GPU tests): FP8 kernels and end to end on an H200,
# then the FP8 and KV-tier GPU tests, within one 600 s call. Needs $OUT and the wheels of
# `DEST=.whl_gpu SKIP=smg scripts/fetch_device_wheels.sh` (carry .whl_gpu). BUDGET: seconds for all of it
# (default 575); SKIP_PIP=1 when the wheels are installed already.
cd "$(dirname "$0")/.."
[ -n "$SKIP_PIP" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $OUT/nvidia_smi.txt
T0=$(date +%s)
timeout 140 python3 benchmarks/fp8_kernels.py --out $OUT/fp8_kernels.json > $OUT/fp8_kernels.log 2>&1; echo "fp8_kernels rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
timeout $(( ${BUDGET:-575} > 500 ? 290 : 250 )) python3 benchmarks/fp8_e2e.py --out $OUT/fp8_e2e.json > $OUT/fp8_e2e.log 2>&1; echo "fp8_e2e rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
LEFT=$(( ${BUDGET:-575} - ($(date +%s)-T0) ))
[ $LEFT -gt 20 ] && timeout $LEFT python3 -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_kv_tiers_gpu.py -k "not presets" -x -p no:cacheprovider > $OUT/tests_fp8_kv.log 2>&1; echo "tests rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
cat $OUT/summary.txt; tail -5 $OUT/tests_fp8_kv.log
