#!/usr/bin/env bash
# On a GPU host, from a bundle made by tools/gpu/bundle.sh: the broker-speed measurements
# (step-bench, then serve-bench RUNS times) on a tiny-v152k model made there.
# Usage: tools/gpu/serve-bench-runs.sh BUNDLE RUNS OUTDIR [serve-bench flags...]
set -euo pipefail
bundle=$1 runs=$2 out=$3
shift 3
export LD_LIBRARY_PATH=$bundle/lib
model=/tmp/bulkhead-tiny-v152k
[ -d "$model" ] || "$bundle/bulkhead" make-model --shape tiny-v152k --out "$model" > /dev/null
nproc
"$bundle/bulkhead" step-bench --model "$model" --batches 1,8,32,64 --iterations 200 \
  2>&1 | tee "$out/step-bench.txt"
for i in $(seq 1 "$runs"); do
  "$bundle/bulkhead" serve-bench --model "$model" --concurrency 1,32,64 \
    --json "$out/serve-bench-$i.json" "$@" 2>&1 | tee "$out/serve-bench-$i.txt"
done
