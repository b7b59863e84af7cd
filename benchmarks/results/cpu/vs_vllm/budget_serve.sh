#!/usr/bin/env bash
# Our server alone at one CPU step budget: vLLM's bench serve client (as run.sh runs it) at c=4 and c=16,
# 2 rounds, one line per run (the A/B in budget_ab.txt ran it for 2048, 1024, 2048, 1024).
#   benchmarks/results/cpu/vs_vllm/budget_serve.sh OUT_DIR BUDGET [extra serve args...]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=$1; BUDGET=$2; shift 2
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
PY=${PY:-$PWD/.venv/bin/python}; [ -x "$PY" ] || PY=/work/main/.venv/bin/python
MODEL=$($PY -c 'from tokenspeed.models.embedded.materialize import embedded_model_path; print(embedded_model_path())')
$PY -m tokenspeed.cli serve --model "$MODEL" --served-model-name embedded --port 8110 --max-model-len 2048 \
  --dtype float32 --disable-access-log --max-num-batched-tokens $BUDGET "$@" > "$OUT/server.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf http://127.0.0.1:8110/v1/models >/dev/null && break; sleep 1; done
for round in 1 2; do for c in 4 16; do
  prompts=$((c * 8 > 16 ? c * 8 : 16))
  ${VLLM_VENV:-/tmp/vllm-venv}/bin/python -c 'import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))' --backend openai --base-url http://127.0.0.1:8110 --endpoint /v1/completions \
    --model embedded --tokenizer "$MODEL" --dataset-name random --random-input-len 512 --random-output-len 64 \
    --num-prompts $prompts --max-concurrency $c --ignore-eos --temperature 0 --seed $((round + 10)) --disable-tqdm \
    > "$OUT/c$c-r$round.txt" 2>&1
  echo "budget $BUDGET c=$c r=$round: $(grep -E 'Output token throughput' "$OUT/c$c-r$round.txt" | awk '{print $NF}') tok/s, TTFT $(grep 'Mean TTFT' "$OUT/c$c-r$round.txt" | awk '{print $NF}'), TPOT $(grep 'Mean TPOT' "$OUT/c$c-r$round.txt" | awk '{print $NF}') load $(cut -d' ' -f1 /proc/loadavg)"
done; done
