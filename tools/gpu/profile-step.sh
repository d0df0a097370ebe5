#!/usr/bin/env bash
# On a GPU host: per-kernel GPU time of decode steps on the CUDA backend (ncu, launched one by
# one), summed by kernel name. Usage: tools/gpu/profile-step.sh BUNDLE OUTDIR SHAPE BATCH
set -uo pipefail
bundle=$1 out=$2 shape=$3 batch=$4
export LD_LIBRARY_PATH=$bundle/lib
model=/tmp/bulkhead-$shape
[ -d "$model" ] || timeout 300 "$bundle/bulkhead" make-model --shape "$shape" --out "$model" > /dev/null
# Skip the first steps' launches, then profile about two steps' worth.
timeout 300 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum \
  --launch-skip 3000 --launch-count 600 --csv \
  "$bundle/bulkhead" step-bench --model "$model" --backend cuda --batches "$batch" \
  --iterations 30 --worker-arg=--no-cuda-graphs > "$out/ncu-$shape-$batch.csv" 2> "$out/ncu-$shape-$batch.err"
echo "ncu rc=$?"
python3 - "$out/ncu-$shape-$batch.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
name_i = head.index("Kernel Name"); val_i = head.index("Metric Value"); unit_i = head.index("Metric Unit")
total = collections.defaultdict(float); count = collections.Counter()
for r in rows:
    v = float(r[val_i].replace(",", ""))
    if r[unit_i] == "nsecond": v /= 1000
    elif r[unit_i] == "msecond": v *= 1000
    name = r[name_i].split("(")[0][:60]
    total[name] += v; count[name] += 1
all_us = sum(total.values())
print(f"{len(rows)} launches, {all_us:.1f} us of GPU time")
for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{us:10.1f} us {count[name]:5d} x {us / count[name]:8.2f} us  {name}")
PY
