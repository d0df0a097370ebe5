#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run every ctest label (gpu tests skip
# cleanly without a device). With --sanitize: an AddressSanitizer + UBSan build of the unit tests.
# With --tsan: a ThreadSanitizer build of the broker's unit tests (the scheduler, the router and
# their threads against fake workers).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/tools/setup.sh"
if [ "${1:-}" = "--sanitize" ]; then
  build="$root/build-asan"
  "$root/tools/build.sh" "$build" -DBULKHEAD_SANITIZE=ON -DBULKHEAD_CUDA=OFF
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
  ctest --test-dir "$build" -L unit -j "$(nproc)" --output-on-failure
elif [ "${1:-}" = "--tsan" ]; then
  build="$root/build-tsan"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBULKHEAD_TSAN=ON \
    -DBULKHEAD_CUDA=OFF > /dev/null
  cmake --build "$build" -j "$(nproc)" --target broker_unit_tests
  TSAN_OPTIONS=halt_on_error=1 "$build/tests/broker_unit_tests"
else
  build="$root/build"
  "$root/tools/build.sh" "$build"
  ctest --test-dir "$build" -j "$(nproc)" --output-on-failure
fi
