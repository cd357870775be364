#!/usr/bin/env bash
# On a GPU machine, after scripts/gpu_check.sh has built pagedkv: compute-sanitizer over the CUDA
# tests of the kernels (not the model-level tests: HF models under the sanitizer take hours).
#   memcheck   out-of-bounds and misaligned accesses, leaks, errors of the CUDA API
#   racecheck  shared-memory hazards, bf16 tests only (the hazards do not depend on the dtype)
# The tests come in three groups, each a few minutes under memcheck on an H100 (all of them at
# once exceed a 10-minute call): decode (paged decode attention, RoPE + KV write, copy_blocks),
# prefill (paged prefill attention), dense (SiLU*mul, norms, sampling, linear).
# Logs go to $OUT (else ./results): sanitize_<tool>_<group>.log, and a summary line each in
# sanitize_summary.txt.
# Usage: scripts/gpu_sanitize.sh memcheck|racecheck [decode|prefill|dense|all] [-- pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
TOOL=${1:?usage: gpu_sanitize.sh memcheck|racecheck [decode|prefill|dense|all] [-- pytest args]}
GROUP=${2:-all}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)

files_of() {
  case "$1" in
    decode) echo tests/test_paged_attention.py tests/test_rope.py tests/test_copy_blocks.py ;;
    prefill) echo tests/test_paged_prefill_attention.py ;;
    dense) echo tests/test_activation.py tests/test_norm.py tests/test_sampling.py tests/test_linear.py ;;
    *) echo "gpu_sanitize.sh: unknown group '$1' (decode, prefill, dense, all)" >&2; exit 2 ;;
  esac
}
case "$TOOL" in
  memcheck) EXPR="not long_context or float16" ;;  # the longest contexts in one dtype: same code
  racecheck) EXPR="bfloat16 and not long_context" ;;
  *) echo "gpu_sanitize.sh: unknown tool '$TOOL' (memcheck, racecheck)" >&2; exit 2 ;;
esac

GROUPS_RUN=$([ "$GROUP" = all ] && echo decode prefill dense || echo "$GROUP")
for group in $GROUPS_RUN; do files_of "$group" > /dev/null || exit 2; done

status=0
for group in $GROUPS_RUN; do
  log="$RESULTS/sanitize_${TOOL}_${group}.log"
  # Without the caching allocator every tensor is its own allocation, so an access past its end
  # is caught instead of landing in a neighbouring cached block.
  # shellcheck disable=SC2046
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$TOOL" --error-exitcode 1 --print-limit 20 \
    "$PY" -m pytest -m cuda -q -p no:cacheprovider $(files_of "$group") -k "$EXPR" "$@" > "$log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || status=1
  echo "$TOOL $group: $(grep -E 'passed|failed|no tests ran' "$log" | tail -1) |" \
       "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) (exit $rc)" |
    tee -a "$RESULTS/sanitize_summary.txt"
done
exit $status
