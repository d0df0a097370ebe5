#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for SECONDS (default 30)
# from its checked-in seed corpus (tests/fuzz/corpus/NAME, copied: the run adds nothing to it).
# A crash, a sanitizer report or a broken invariant fails the run and leaves the input in
# build-fuzz/findings. Usage: tools/fuzz.sh [SECONDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-30}
"$root/tools/setup.sh"
build="$root/build-fuzz"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DBULKHEAD_FUZZ=ON \
  -DBULKHEAD_CUDA=OFF > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
targets=(safetensors request step_decode arena_row)
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
mkdir -p "$build/findings"
for t in "${targets[@]}"; do
  work=$(mktemp -d)
  cp "$root/tests/fuzz/corpus/$t/"* "$work/"
  echo "fuzz_$t: ${seconds}s"
  "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$build/findings/$t-" "$work" 2>&1 | tail -4
  status=${PIPESTATUS[0]}
  rm -rf "$work"
  [ "$status" -eq 0 ] || { echo "fuzz_$t found a failure: $build/findings"; exit 1; }
done
echo "fuzzers: no findings"
echo "fuzz: ${#targets[@]} passed, 0 failed"
