#!/usr/bin/env bash
# Bundles the built executables and GPU tests with their shared libraries into a folder git
# ignores (.gpu/ by default), for a GPU host that has CUDA but none of the -dev packages. Then on
# that host: LD_LIBRARY_PATH=.gpu/lib .gpu/<binary>. Usage: tools/gpu/bundle.sh [BUILD_DIR
# [OUT_DIR]]; OUT_DIR may lie in another worktree of the repository (a branch's build bundled
# into the checkout that runs it). The bundle gets this checkout's tools/gpu/pending-runs.sh.
# BUNDLE_AB="NAME=PATH ...": other builds' bulkhead executables for pending-runs.sh's ab groups
# (NAME base, or ab-SOMETHING), stripped and packed together with xz into variants.tar.xz (which
# pending-runs.sh unpacks), since each would take 8 MB of what a run may carry.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=${2:-$root/.gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Ignored where it lies: its checkout's path in the repository's shared exclude file.
top=$(git -C "$out/.." rev-parse --show-toplevel)
exclude=$(git -C "$top" rev-parse --git-common-dir)/info/exclude
case $exclude in /*) ;; *) exclude=$top/$exclude ;; esac
entry=/${out#"$top"/}/
grep -qxF "$entry" "$exclude" 2>/dev/null || echo "$entry" >> "$exclude"
rm -rf "$out"
files=("$build"/bin/bulkhead "$build"/bin/bulkhead-broker "$build"/bin/bulkhead-worker)
[ -x "$build/tests/gpu_tests" ] && files+=("$build/tests/gpu_tests")
"$root/../shared/tools/bundle-runtime.sh" "$out" "${files[@]}"
cp -r "$root/../shared/fixtures" "$out/fixtures"
cp "$root/tools/gpu/pending-runs.sh" "$out/"
# Debug information would take the bundle past what a run may carry.
strip --strip-debug "$out"/bulkhead* "$out"/lib/* 2>/dev/null || true
[ -x "$out/gpu_tests" ] && strip --strip-debug "$out/gpu_tests"
if [ -n "${BUNDLE_AB:-}" ]; then
  variants=$(mktemp -d)
  for pair in $BUNDLE_AB; do
    strip -o "$variants/bulkhead-${pair%%=*}" "${pair#*=}"
  done
  tar cf - -C "$variants" . | xz -T2 -6 > "$out/variants.tar.xz"
  rm -rf "$variants"
fi
du -sh "$out"
