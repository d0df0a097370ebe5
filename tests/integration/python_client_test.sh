#!/usr/bin/env bash
# The Python client example against a real broker: same tokens as `bulkhead generate`.
# Usage: python_client_test.sh BIN_DIR FIXTURE_DIR SOURCE_DIR
set -euo pipefail
bin=$1 fixture=$2 src=$3
dir=$(mktemp -d)
trap 'kill $broker 2>/dev/null || true; wait $broker 2>/dev/null || true; rm -rf "$dir"' EXIT
"$bin/bulkhead-broker" --model "$fixture" --listen 127.0.0.1:0 --backend cpu \
  --ready-file "$dir/ready" --state-dir "$dir/state" --log-level warn &
broker=$!
for _ in $(seq 600); do [ -s "$dir/ready" ] && break; kill -0 $broker; sleep 0.1; done
addr=$(cat "$dir/ready")
want=$("$bin/bulkhead" generate --server "$addr" --tokens 369,137,41,124 --max-tokens 12 \
  --temperature 0.8 --seed 3 --ignore-eos 2>/dev/null)
got=$(/usr/bin/python3 "$src/tools/generate_client.py" --server "$addr" --tokens 369,137,41,124 \
  --max-tokens 12 --temperature 0.8 --seed 3 --ignore-eos 2>/dev/null)
echo "bulkhead generate: $want"
echo "python client:     $got"
[ -n "$want" ] && [ "$want" = "$got" ]
