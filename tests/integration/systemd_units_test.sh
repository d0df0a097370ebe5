#!/usr/bin/env bash
# systemd-analyze verify on every unit in systemd/, with ExecStart pointing at the built binaries
# (the units name /usr/local/bin, where an install puts them). Any warning fails the test. Then
# the sysusers.d and tmpfiles.d files, applied to an empty root: the user, and its directories
# owner-only. Last, the TOML examples: each reads back through its binary's --print-config
# unchanged, so it lists every option with its current help.
# Usage: systemd_units_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
command -v systemd-analyze > /dev/null || { echo "systemd-analyze not found (install systemd)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for unit in "$src"/systemd/*.service "$src"/systemd/*.target; do
  sed "s|/usr/local/bin/|$bin/|g" "$unit" > "$tmp/$(basename "$unit")"
done
# A template is verified through an instance.
cp "$tmp/bulkhead-worker@.service" "$tmp/bulkhead-worker@0.service"
cd "$tmp"
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no ./bulkhead-broker.service \
  ./bulkhead-worker@0.service ./bulkhead.target 2>&1) || { echo "$out"; exit 1; }
if [ -n "$out" ]; then
  echo "$out"
  exit 1
fi
echo "units verified"

root="$tmp/root"
mkdir -p "$root/etc"
systemd-sysusers --root="$root" "$src/systemd/bulkhead.sysusers" > /dev/null
uid=$(awk -F: '$1 == "bulkhead" { print $3 }' "$root/etc/passwd")
[ -n "$uid" ] || { echo "sysusers made no bulkhead user"; exit 1; }
systemd-tmpfiles --create --root="$root" "$src/systemd/bulkhead.tmpfiles"
for dir in /run/bulkhead /var/lib/bulkhead /etc/bulkhead; do
  got=$(stat -c '%a %u' "$root$dir")
  [ "$got" = "700 $uid" ] || { echo "$dir: mode and owner $got, want 700 $uid"; exit 1; }
done
echo "sysusers and tmpfiles applied"

for example in broker worker; do
  file="$src/systemd/$example.toml.example"
  "$bin/bulkhead-$example" --config "$file" --print-config > "$tmp/$example.toml"
  diff -u "$file" "$tmp/$example.toml" > "$tmp/$example.diff" || {
    cat "$tmp/$example.diff"
    echo "systemd/$example.toml.example is not what bulkhead-$example --print-config gives for it" \
      "(an option missing or its help changed: regenerate it with --config FILE --print-config)"
    exit 1
  }
done
echo "TOML examples list every option"
