#!/usr/bin/env bash
# Put a git revision's tree (default: main) in _ab_base/ (ignored), for scripts/gpu_ab_run.sh to time the
# working tree against it in one device call. Weights and results stay out: the carry limit is 64 MiB.
set -eu
cd "$(dirname "$0")/.."
rm -rf _ab_base && mkdir _ab_base
git archive "${1:-main}" tokenspeed benchmarks/*.py scripts pyproject.toml | tar -x -C _ab_base
find _ab_base -name "*.safetensors" -delete
git rev-parse "${1:-main}" > _ab_base/REVISION
du -sh _ab_base
