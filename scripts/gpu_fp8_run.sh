#!/usr/bin/env bash
# One device call for issue 16's FP8 figures, each step under its own time limit (seconds, 0 skips it):
# GPU tests (TESTS files, TEST_K selection; TESTS_S), fp8_e2e.py (E2E_SECTIONS; E2E_S), gemv_stack.py
# (STACK_S), fp8_skinny_stack.py (SKINNY_S), fp8_kernels.py (KERNELS_S); E2E_ARGS / STACK_ARGS: more arguments. Everything lands in
# $OUT/fp8.tgz, re-packed after every step so that a call cut short keeps what finished.
# Carry .whl_gpu (scripts/fetch_device_wheels.sh).
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENSPEED_GPU_REPORT=/tmp/fp8/gpu_report.jsonl
R=/tmp/fp8
rm -rf $R && mkdir -p $R  # a warm machine keeps /tmp: no earlier call's files in this one's archive
T0=$(date +%s)
step() {
  local name=$1 limit=$2
  shift 2
  [ "$limit" = 0 ] && return
  timeout "$limit" "$@" > $R/$name.log 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))" >> $R/summary.txt
  tar czf $OUT/fp8.tgz -C /tmp fp8
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/summary.txt
step gpu_tests ${TESTS_S:-120} python3 -m pytest -q -m gpu -rf -p no:cacheprovider \
  ${TESTS:-tests/test_kernels_fp8_gpu.py tests/test_fp8_gpu.py} -k "${TEST_K:-not presets}"
step skinny_stack ${SKINNY_S:-0} python3 benchmarks/fp8_skinny_stack.py --out $R/skinny_stack.json
step fp8_e2e ${E2E_S:-200} python3 benchmarks/fp8_e2e.py --sections ${E2E_SECTIONS:-llama} --profile ${E2E_ARGS:-} --out $R/fp8_e2e.json
step gemv_stack ${STACK_S:-180} python3 benchmarks/gemv_stack.py ${STACK_ARGS:-} --out $R/gemv_stack.json
step fp8_kernels ${KERNELS_S:-0} python3 benchmarks/fp8_kernels.py --out $R/fp8_kernels.json
cat $R/summary.txt; tail -3 $R/gpu_tests.log 2>/dev/null
