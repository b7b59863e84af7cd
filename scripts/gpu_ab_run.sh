#!/usr/bin/env bash
# One device call that times the working tree against _ab_base/ (scripts/ab_base.sh) side by side.
#   bash scripts/gpu_ab_run.sh STEPS_FILE      (carry .whl_gpu and _ab_base)
# STEPS_FILE is sourced: lines `step NAME SECONDS DIR [VAR=value ...] command ...`, DIR `.` (the working
# tree) or `_ab_base`; each runs in DIR with its own package on PYTHONPATH, output in $R/NAME.log
# ($R = $OUT/ab; point --out there). Everything is packed into $OUT/ab.tgz after each step (the tool
# returns only a few loose files), so a call cut short keeps what finished.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD R=$OUT/ab T0=$(date +%s)
mkdir -p "$R"
cp "$1" "$R/steps.sh"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$R/summary.txt"
step() {
  local name=$1 limit=$2 dir=$3
  shift 3
  (cd "$ROOT/$dir" && PYTHONPATH=/tmp/site:$ROOT/$dir TOKENSPEED_GPU_REPORT=$R/$name.report.jsonl \
    timeout "$limit" env "$@") > "$R/$name.log" 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))" >> "$R/summary.txt"
  tar czf "$OUT/ab.tgz" -C "$OUT" ab
}
source "$1"
cat "$R/summary.txt"
grep -h "TPOT\|passed\|failed" "$R"/*.log
