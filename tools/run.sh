#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build, make the embedded default
# model (random weights, `tiny` shape), start the broker on it, show one generation through
# `bulkhead generate`, and keep serving until Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/tools/setup.sh"
"$root/tools/build.sh" "$root/build"
bin="$root/build/bin"
model="$root/build/models/tiny"
[ -f "$model/config.json" ] || "$bin/bulkhead" make-model --shape tiny --out "$model" --seed 0
ready=$(mktemp -u /tmp/bulkhead-ready.XXXXXX)
"$bin/bulkhead-broker" --model "$model" --listen "${BULKHEAD_LISTEN:-127.0.0.1:0}" \
  --ready-file "$ready" &
broker=$!
trap 'kill -TERM $broker 2>/dev/null; wait $broker 2>/dev/null; rm -f "$ready"' EXIT INT TERM
for _ in $(seq 600); do
  [ -s "$ready" ] && break
  kill -0 $broker 2>/dev/null || { echo "the broker exited during start" >&2; exit 1; }
  sleep 0.1
done
addr=$(cat "$ready")
echo "broker serving on $addr; one generation (prompt 1,2,3, 16 tokens, seed 7):"
"$bin/bulkhead" generate --server "$addr" --tokens 1,2,3 --max-tokens 16 --temperature 0.8 \
  --seed 7 --ignore-eos
echo "serving on $addr until Ctrl-C (try: $bin/bulkhead generate --server $addr --tokens 1,2,3)"
wait $broker
