#!/usr/bin/env bash
# On a GPU machine: A/B of patches in one call, so every side runs on the same machine, clocks and
# driver (a difference smaller than the run-to-run spread is noise; two separate calls can land on
# two different machines). A: the tree as it is, built and benchmarked. Then each VARIANT: a patch,
# or patches joined by "+" applied in that order (e.g. lab/experiments/*.patch), rebuilt
# (incremental: only what the patches touch), its CUDA tests run (it must pass them), the same
# benchmarks, and the patches reversed. A is rebuilt at the end, so a later call on the same
# machine starts from A again. A is measured once for all variants: two variants fit a call where
# two A/B calls would each pay for the machine's start and for A.
# Writes to $OUT (else ./results): ab.md (A's summary, then each variant's), ab_files.tgz (every
# side's logs and plots). With .whl carried, gpu_check.sh installs the wheels (FlashInfer for
# W3's column). BENCH_<NAME>_ARGS pass through to the benchmarks (see gpu_check.sh).
# --rounds N runs the whole sequence (A, B1, B2, ...) N times (ABAB...): a difference that holds
# in every round is not the machine drifting between sides; tests run in the first round only.
# Usage: lab/gpu_ab.sh [--rounds N] --bench NAME[,NAME...] VARIANT... [-- PYTEST_ARGS]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
usage="usage: gpu_ab.sh [--rounds N] --bench NAME[,NAME...] VARIANT... [-- PYTEST_ARGS]; VARIANT = PATCH[+PATCH...]"
ROUNDS=1
if [ "${1:-}" = "--rounds" ]; then
  ROUNDS=${2:?$usage}
  [[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_ab.sh: --rounds takes a positive integer, got '$ROUNDS'" >&2; exit 2; }
  shift 2
fi
[ "${1:-}" = "--bench" ] || { echo "$usage" >&2; exit 2; }
BENCH=${2:?$usage}
shift 2
VARIANTS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VARIANTS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#VARIANTS[@]} -gt 0 ] || { echo "$usage" >&2; exit 2; }

source lab/ab_variants.sh
check_variants gpu_ab.sh "${VARIANTS[@]}"

SIDES=$(mktemp -d)
status=0
# ab.md grows after each side, so a call that runs out of time still returns the sides it ran.
report() {  # TITLE SIDE_DIR
  { echo; echo "# $1"; sed 's/^#/##/' "$2/summary.md" 2>/dev/null || echo "(no summary)"; } >> "$RESULTS/ab.md"
  tar -czf "$RESULTS/ab_files.tgz" -C "$SIDES" .
}
echo "# A/B on one machine: A = the tree; B1..B${#VARIANTS[@]} = A + each variant; $ROUNDS round(s)" > "$RESULTS/ab.md"
for (( round = 1; round <= ROUNDS; round++ )); do
  suffix=""; [ "$ROUNDS" -gt 1 ] && suffix=" (round $round)"
  echo "== A: the tree as it is$suffix"
  OUT=$SIDES/a$round scripts/gpu_check.sh --no-tests --bench "$BENCH" > /dev/null 2>&1 || status=1
  report "A$suffix" "$SIDES/a$round"
  n=0
  for v in "${VARIANTS[@]}"; do
    n=$((n + 1))
    echo "== B$n: $v$suffix"
    read -r -a patches <<< "$(patches_of "$v")"
    for p in "${patches[@]}"; do git apply "$p"; done
    tests=(); [ "$round" -gt 1 ] && tests=(--no-tests)
    OUT=$SIDES/b$n.$round scripts/gpu_check.sh "${tests[@]}" --bench "$BENCH" -- "$@" > /dev/null 2>&1 || status=1
    unapply "${patches[@]}"
    report "B$n = A + $v$suffix" "$SIDES/b$n.$round"
  done
done
# Leave A's build installed: the machine stays warm between calls, and a later call (e.g.
# gpu_sanitize.sh) must find the build of the tree it was sent.
OUT=$SIDES/rebuild scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1
cat "$RESULTS/ab.md"
exit $status
