#!/usr/bin/env bash
# Builds `bulkhead` at other revisions, for pending-runs.sh's ab groups: for each NAME=REV, checks
# out REV (a commit; REV+C1+C2 is REV with commits C1, C2 picked onto it, uncommitted) in the
# build's own checkout, builds the bulkhead target incrementally in BUILD_DIR and keeps the
# executable as OUT_DIR/bulkhead-NAME; then goes back to the branch it started on and rebuilds
# that. Prints the BUNDLE_AB value for tools/gpu/bundle.sh. The working tree must be clean.
# Usage: tools/gpu/ab-builds.sh BUILD_DIR OUT_DIR NAME=REV... (NAME: base, or ab-SOMETHING)
# Example: AB=$(tools/gpu/ab-builds.sh build /tmp/ab base=8c64e3b ab-count=8c64e3b+03f00a3)
#          BUNDLE_AB="$AB" tools/gpu/bundle.sh build .gpu
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
build=$1 out=$2
shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "ab-builds: the working tree has changes; commit or stash them first" >&2
  exit 1
fi
start=$(git symbolic-ref --quiet --short HEAD || git rev-parse HEAD)
mkdir -p "$out"
out=$(cd "$out" && pwd)
restore() {
  git reset --quiet --hard
  git checkout --quiet "$start"
}
trap restore EXIT
ab=""
for pair in "$@"; do
  name=${pair%%=*} spec=${pair#*=}
  IFS=+ read -r -a parts <<< "$spec"
  git checkout --quiet --detach "${parts[0]}"
  for pick in "${parts[@]:1}"; do git cherry-pick --no-commit "$pick" > /dev/null; done
  echo "ab-builds: $name = $spec" >&2
  cmake --build "$build" -j2 --target bulkhead > "$out/build-$name.log" 2>&1 ||
    { echo "ab-builds: $name did not build (see $out/build-$name.log)" >&2; exit 1; }
  cp "$build/bin/bulkhead" "$out/bulkhead-$name"
  ab+="${ab:+ }$name=$out/bulkhead-$name"
  git reset --quiet --hard
done
restore
trap - EXIT
echo "ab-builds: back on $start, rebuilding it" >&2
cmake --build "$build" -j2 > "$out/build-back.log" 2>&1
echo "$ab"
