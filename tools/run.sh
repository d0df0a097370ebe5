#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build, make the embedded default
# model (random weights, `tiny` shape) and generate from it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/tools/setup.sh"
"$root/tools/build.sh" "$root/build"
model="$root/build/models/tiny"
[ -f "$model/config.json" ] || "$root/build/bin/bulkhead" make-model --shape tiny --out "$model" --seed 0
echo "generating 16 tokens after the prompt 1,2,3 on $model:"
"$root/build/bin/bulkhead" generate --model "$model" --tokens 1,2,3 --max-tokens 16
