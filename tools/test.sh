#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run every ctest label (gpu tests skip
# cleanly without a device). With --sanitize: an AddressSanitizer + UBSan build of the unit tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/tools/setup.sh"
if [ "${1:-}" = "--sanitize" ]; then
  build="$root/build-asan"
  "$root/tools/build.sh" "$build" -DBULKHEAD_SANITIZE=ON -DBULKHEAD_CUDA=OFF
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
  ctest --test-dir "$build" -L unit -j "$(nproc)" --output-on-failure
else
  build="$root/build"
  "$root/tools/build.sh" "$build"
  ctest --test-dir "$build" -j "$(nproc)" --output-on-failure
fi
