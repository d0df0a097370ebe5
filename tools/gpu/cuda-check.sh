#!/usr/bin/env bash
# On a GPU host, from a bundle made by tools/gpu/bundle.sh: the GPU tests, then step-bench on the
# CUDA backend for each model shape given. Usage: tools/gpu/cuda-check.sh BUNDLE OUTDIR SHAPE...
set -uo pipefail
bundle=$1 out=$2
shift 2
export LD_LIBRARY_PATH=$bundle/lib BULKHEAD_FIXTURES_DIR=$bundle/fixtures
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
timeout 300 "$bundle/gpu_tests" > "$out/gpu_tests.txt" 2>&1
echo "gpu_tests rc=$?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error|Expected|Which is|actual" "$out/gpu_tests.txt" | head -60
for shape in "$@"; do
  model=/tmp/bulkhead-$shape
  [ -d "$model" ] || timeout 300 "$bundle/bulkhead" make-model --shape "$shape" --out "$model" > /dev/null
  timeout 200 "$bundle/bulkhead" step-bench --model "$model" --backend cuda --batches 1,8,32,64 \
    --iterations 100 2>&1 | tee "$out/step-bench-$shape.txt" | grep -v '^\['
done
# serve-bench through a broker on the CUDA backend, for each shape in SERVE_SHAPES.
for shape in ${SERVE_SHAPES:-}; do
  model=/tmp/bulkhead-$shape
  [ -d "$model" ] || timeout 300 "$bundle/bulkhead" make-model --shape "$shape" --out "$model" > /dev/null
  timeout 300 "$bundle/bulkhead" serve-bench --model "$model" --backend cuda \
    --concurrency 1,32,64 --json "$out/serve-bench-$shape.json" 2>&1 |
    tee "$out/serve-bench-$shape.txt" | grep -v '^\['
done
