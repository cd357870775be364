#!/usr/bin/env bash
# On a GPU machine: per-kernel A/B of patches in one call, by lab/step_profile.py (each kernel's
# time alone on the device a decode step), where a step-level benchmark would hide which kernel
# moved. A: the tree, built, then each PROFILE. Then each VARIANT (a patch, or patches joined by
# "+", applied in that order) rebuilt incrementally with its CUDA tests (PYTEST_ARGS, as
# gpu_ab.sh's; none: no tests) and the same profiles, its patches reversed after; A rebuilt at the end.
# PROFILE: step_profile.py's arguments as one word with commas for spaces, e.g.
# "--model,moe,--layers,16,--format,int4". Writes $OUT/profile_ab.md (else ./results), growing
# after each side, so a call that runs out of time still returns the sides it ran.
# Usage: lab/profile_ab.sh --profiles PROFILE[;PROFILE...] VARIANT... [-- PYTEST_ARGS]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
usage="usage: profile_ab.sh --profiles PROFILE[;PROFILE...] VARIANT... [-- PYTEST_ARGS]"
[ "${1:-}" = "--profiles" ] || { echo "$usage" >&2; exit 2; }
IFS=';' read -r -a PROFILES <<< "${2:?$usage}"
shift 2
VARIANTS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VARIANTS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#VARIANTS[@]} -gt 0 ] || { echo "$usage" >&2; exit 2; }

source lab/ab_variants.sh
check_variants profile_ab.sh "${VARIANTS[@]}"

REPORT="$RESULTS/profile_ab.md"
SIDES=$(mktemp -d)
status=0
side() {  # TITLE: the profiles of the build installed now, appended to the report
  { echo; echo "# $1"; } >> "$REPORT"
  for profile in "${PROFILES[@]}"; do
    read -r -a args <<< "$(tr ',' ' ' <<< "$profile")"
    { echo; echo "## step_profile.py ${args[*]}"; echo '```'; } >> "$REPORT"
    python3 lab/step_profile.py "${args[@]}" 2>&1 | grep -v "it/s\]" | sed -n 1,16p >> "$REPORT" || status=1
    echo '```' >> "$REPORT"
  done
}
echo "# per-kernel A/B on one machine: A = the tree; B1..B${#VARIANTS[@]} = A + each variant" > "$REPORT"
echo "== A: the tree as it is"
OUT=$SIDES/a scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1
side "A"
n=0
for v in "${VARIANTS[@]}"; do
  n=$((n + 1))
  echo "== B$n: $v"
  read -r -a patches <<< "$(patches_of "$v")"
  for p in "${patches[@]}"; do git apply "$p"; done
  tests=(--no-tests); [ $# -gt 0 ] && tests=(--bench none --)  # no PYTEST_ARGS: no tests (not all)
  OUT=$SIDES/b$n scripts/gpu_check.sh "${tests[@]}" "$@" > /dev/null 2>&1 || status=1
  { echo; echo "# B$n = A + $v"; grep "cuda tests" "$SIDES/b$n/summary.md" || echo "(no test line)"; } >> "$REPORT"
  side "B$n profiles"
  unapply "${patches[@]}"
done
OUT=$SIDES/rebuild scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1
cat "$REPORT"
exit $status
