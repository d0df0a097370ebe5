#!/usr/bin/env bash
# On a GPU host: the GPU time of each kernel of one step on the CUDA backend (ncu, launches one
# by one), summed by kernel name: a teacher-forced pass over TOKENS tokens (`bulkhead logits`,
# in one process). Usage: tools/gpu/profile-step.sh BUNDLE OUTDIR SHAPE TOKENS
set -uo pipefail
bundle=$1 out=$2 shape=$3 tokens=$4
export LD_LIBRARY_PATH=$bundle/lib
model=/tmp/bulkhead-$shape
[ -d "$model" ] || timeout 300 "$bundle/bulkhead" make-model --shape "$shape" --out "$model" > /dev/null
list=$(seq -s, 1 "$tokens")
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  "$bundle/bulkhead" logits --model "$model" --backend cuda --tokens "$list" --out /tmp/logits.f32 \
  > "$out/ncu-$shape-$tokens.csv" 2> "$out/ncu-$shape-$tokens.err"
echo "ncu rc=$?"
python3 - "$out/ncu-$shape-$tokens.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
name_i = head.index("Kernel Name"); val_i = head.index("Metric Value"); unit_i = head.index("Metric Unit")
total = collections.defaultdict(float); count = collections.Counter()
for r in rows:
    v = float(r[val_i].replace(",", ""))
    v = {"ns": v / 1000, "nsecond": v / 1000, "ms": v * 1000, "msecond": v * 1000}.get(r[unit_i], v)
    name = r[name_i].split("(")[0][:70]
    total[name] += v; count[name] += 1
print(f"{len(rows)} launches, {sum(total.values()):.1f} us of GPU time")
for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{us:10.1f} us {count[name]:5d} x {us / count[name]:8.2f} us  {name}")
PY
