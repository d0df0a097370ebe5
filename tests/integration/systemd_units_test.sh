#!/usr/bin/env bash
# systemd-analyze verify on every unit in systemd/, with ExecStart pointing at the built binaries
# (the units name /usr/local/bin, where an install puts them). Any warning fails the test.
# Usage: systemd_units_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
command -v systemd-analyze > /dev/null || { echo "systemd-analyze not found (install systemd)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for unit in "$src"/systemd/*.service; do
  sed "s|/usr/local/bin/|$bin/|g" "$unit" > "$tmp/$(basename "$unit")"
done
# A template is verified through an instance.
cp "$tmp/bulkhead-worker@.service" "$tmp/bulkhead-worker@0.service"
cd "$tmp"
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no ./bulkhead-broker.service \
  ./bulkhead-worker@0.service 2>&1) || { echo "$out"; exit 1; }
if [ -n "$out" ]; then
  echo "$out"
  exit 1
fi
echo "units verified"
