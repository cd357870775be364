#!/usr/bin/env bash
# On a GPU machine: A/B of the tree against the tree + a patch (e.g. the diff back to an older
# commit: `git diff HEAD OLD --binary -M > .ab/old.patch`, carried), each built ONCE into its own
# folder, then one benchmark run alternately A, B, A, B... for N rounds, so the machine's drift
# shows as the spread within each side instead of as a difference between sides. Unlike
# gpu_ab.sh it rebuilds nothing between rounds and runs no tests (gpu_check.sh does those).
# Writes $OUT/ab_installed.md: each run's table, in order. Several benchmarks, separated by "::",
# run one after the other within each side's turn (each side built once for all of them).
# Usage: lab/ab_installed.sh PATCH ROUNDS BENCH_SCRIPT [BENCH_ARGS...] [:: BENCH_SCRIPT [ARGS...]]...
set -uo pipefail
cd "$(dirname "$0")/.."
PATCH=$(realpath "${1:?usage: ab_installed.sh PATCH ROUNDS BENCH_SCRIPT [ARGS...]}")
ROUNDS=${2:?rounds}
: "${3:?benchmark script, e.g. benchmarks/bench_throughput.py}"
shift 2
# BENCHES[i]: one benchmark's command line (script and arguments), split at "::".
BENCHES=()
current=""
for arg in "$@"; do
  if [ "$arg" = "::" ]; then BENCHES+=("$current"); current=""; else current+="${current:+ }$(printf '%q' "$arg")"; fi
done
BENCHES+=("$current")
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PAGEDKV_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export PAGEDKV_CUDA_ARCHS=${PAGEDKV_CUDA_ARCHS:-90}
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
WORK=$(mktemp -d)
tar --exclude=./build --exclude=./.venv --exclude=./.git -cf - . | (mkdir -p "$WORK/A" && cd "$WORK/A" && tar -xf -)
cp -r "$WORK/A" "$WORK/B"
(cd "$WORK/B" && git apply "$PATCH") || { echo "ab_installed: $PATCH does not apply" >&2; exit 2; }
for side in A B; do
  start=$(date +%s)
  "$PY" -m pip install --no-build-isolation --no-deps --quiet --disable-pip-version-check \
    --target "$WORK/site$side" -Cbuild-dir="$WORK/build$side" "$WORK/$side" || exit 1
  echo "built $side in $(( $(date +%s) - start )) s"
done
REPORT="$RESULTS/ab_installed.md"
echo "# ab_installed: A = the tree, B = A + $(basename "$PATCH"); ${BENCHES[*]}" > "$REPORT"
status=0
for (( round = 1; round <= ROUNDS; round++ )); do
  for side in A B; do
    for i in "${!BENCHES[@]}"; do
      echo "== $side, round $round: ${BENCHES[$i]}"
      out="$WORK/out$side$round-$i"
      # Run from the side's own tree (its benchmark scripts) against its own build.
      if (cd "$WORK/$side" && eval "PYTHONPATH=$WORK/site$side $PY ${BENCHES[$i]} --out $out"); then
        { echo; echo "## $side, round $round: ${BENCHES[$i]}"; cat "$out"/*.md; } >> "$REPORT"
      else
        status=1; echo "## $side, round $round: ${BENCHES[$i]}: FAILED" >> "$REPORT"
      fi
    done
  done
done
cat "$REPORT"
exit $status
