#!/usr/bin/env bash
# On a GPU machine: A/B of patches in one call, so both sides run on the same machine, clocks and
# driver (a difference smaller than the run-to-run spread is noise; two separate calls can land on
# two different machines). A: the tree as it is, built and benchmarked. B: the tree with the
# patches applied (e.g. docs/experiments/*.patch), rebuilt (incremental: only what the patches
# touch), its CUDA tests run (B must pass them), and the same benchmarks. Then the patches are
# reversed and A rebuilt, so a later call on the same machine starts from A again.
# Writes to $OUT (else ./results): ab.md (A's then B's summary), ab_files.tgz (both sides' logs
# and plots). With .whl carried, gpu_check.sh installs the wheels (FlashInfer for W3's column).
# Usage: scripts/gpu_ab.sh --bench NAME[,NAME...] PATCH... [-- PYTEST_ARGS]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
usage="usage: gpu_ab.sh --bench NAME[,NAME...] PATCH... [-- PYTEST_ARGS]"
[ "${1:-}" = "--bench" ] || { echo "$usage" >&2; exit 2; }
BENCH=${2:?$usage}
shift 2
PATCHES=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do PATCHES+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#PATCHES[@]} -gt 0 ] || { echo "$usage" >&2; exit 2; }
for p in "${PATCHES[@]}"; do
  git apply --check "$p" || { echo "gpu_ab.sh: $p does not apply to this tree" >&2; exit 2; }
done

SIDES=$(mktemp -d)
status=0
echo "== A: the tree as it is"
OUT=$SIDES/a scripts/gpu_check.sh --no-tests --bench "$BENCH" > /dev/null 2>&1 || status=1
echo "== B: with ${PATCHES[*]}"
for p in "${PATCHES[@]}"; do git apply "$p"; done
OUT=$SIDES/b scripts/gpu_check.sh --bench "$BENCH" -- "$@" > /dev/null 2>&1 || status=1
for (( i = ${#PATCHES[@]} - 1; i >= 0; i-- )); do git apply -R "${PATCHES[$i]}"; done
# Leave A's build installed: the machine stays warm between calls, and a later call (e.g.
# gpu_sanitize.sh) must find the build of the tree it was sent.
OUT=$SIDES/rebuild scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1

{
  echo "# A/B on one machine: B = A + ${PATCHES[*]}"
  echo
  echo "# A"
  sed 's/^#/##/' "$SIDES/a/summary.md"
  echo
  echo "# B"
  sed 's/^#/##/' "$SIDES/b/summary.md"
} > "$RESULTS/ab.md"
tar -czf "$RESULTS/ab_files.tgz" -C "$SIDES" a b
cat "$RESULTS/ab.md"
exit $status
