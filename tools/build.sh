#!/usr/bin/env bash
# Configures and builds bulkhead. Usage: tools/build.sh [BUILD_DIR] [extra cmake args...]
# The CUDA parts build when nvcc is found (/usr/local/cuda), otherwise the build is CPU-only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
# The configure log lives inside the build directory, so no build leaves files beside it.
mkdir -p "$build"
log="$build/configure.log"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" > "$log" 2>&1 ||
  { cat "$log"; exit 1; }
cmake --build "$build" -j "$(nproc)"
