#!/usr/bin/env bash
# Configures and builds bulkhead. Usage: tools/build.sh [BUILD_DIR] [extra cmake args...]
# The CUDA parts build when nvcc is found (/usr/local/cuda), otherwise the build is CPU-only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)"
