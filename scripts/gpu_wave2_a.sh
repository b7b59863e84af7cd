#!/usr/bin/env bash
# Device run A of wave 2 (one 600 s call): issue 12's bs1 regression after the placement merge, then
# issue 16's FP8 measurements and the FP8 / KV-tier GPU tests (scripts/gpu_fp8_checks.sh with what is left).
# Needs $OUT and the wheels of `DEST=.whl_gpu SKIP=smg scripts/fetch_device_wheels.sh` (carry .whl_gpu).
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
T0=$(date +%s)
timeout 110 python3 benchmarks/gpu_suite.py --sections ceilings,engine --bs1-only --out $OUT/llama31_8b_bs1.json > $OUT/bs1.log 2>&1
echo "bs1 rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
BUDGET=$(( 580 - ($(date +%s)-T0) )) SKIP_PIP=1 bash scripts/gpu_fp8_checks.sh
