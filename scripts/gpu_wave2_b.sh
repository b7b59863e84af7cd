#!/usr/bin/env bash
# Device run B of wave 2 (one 600 s call): issue 14's EAGLE head retrained against the shipped
# `embedded` weights, installed in this working copy, then issue 15's speculative-decoding benchmark
# (bs1 per drafter with the new head, and the agentic serve sweep with and without `suffix`).
# EAGLE_ARGS: more train_embedded.py flags (e.g. --eagle-intermediate-size 512). Needs $OUT and the wheels of `DEST=.whl_gpu SKIP=smg scripts/fetch_device_wheels.sh` (carry .whl_gpu).
# The trained package comes back as one tarball ($OUT keeps at most 8 files, 2 folders deep); on the dev
# machine `tar xf <files>/eagle_package.tar` in the repository root installs the head and its record.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1
T0=$(date +%s)
timeout 280 python3 scripts/train_embedded.py --models eagle --out $OUT/train --time-budget ${EAGLE_BUDGET:-230} ${EAGLE_ARGS} > $OUT/train_eagle.log 2>&1
echo "eagle rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
if [ -f $OUT/train/package/tokenspeed/models/embedded/eagle/model.safetensors ]; then
  cp -r $OUT/train/package/tokenspeed/. tokenspeed/ && tar cf $OUT/eagle_package.tar -C $OUT/train/package .
fi
rm -rf $OUT/train
timeout $(( 585 - ($(date +%s)-T0) )) python3 benchmarks/spec_decode.py --sections bs1,serve --out $OUT/spec_decode.json > $OUT/spec.log 2>&1
echo "spec rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/summary.txt
cat $OUT/summary.txt; grep -E "speedup|gain|top1" $OUT/spec_decode.json | head -20
