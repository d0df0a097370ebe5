#!/usr/bin/env bash
# Bundles the built executables and GPU tests with their shared libraries into .gpu/ (ignored by
# git), for a GPU host that has CUDA but none of the -dev packages. Then on that host:
# LD_LIBRARY_PATH=.gpu/lib .gpu/<binary>. Usage: tools/gpu/bundle.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
grep -qx '/.gpu/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$root/.git/info/exclude"
rm -rf "$root/.gpu"
files=("$build"/bin/bulkhead "$build"/bin/bulkhead-broker "$build"/bin/bulkhead-worker)
[ -x "$build/tests/gpu_tests" ] && files+=("$build/tests/gpu_tests")
"$root/../shared/tools/bundle-runtime.sh" "$root/.gpu" "${files[@]}"
cp -r "$root/../shared/fixtures" "$root/.gpu/fixtures"
# Debug information would take the bundle past what a run may carry.
strip --strip-debug "$root"/.gpu/bulkhead* "$root"/.gpu/lib/* 2>/dev/null || true
[ -x "$root/.gpu/gpu_tests" ] && strip --strip-debug "$root/.gpu/gpu_tests"
du -sh "$root/.gpu"
