#!/usr/bin/env bash
# On a GPU machine, after scripts/gpu_check.sh has built pagedkv from this tree (checked: it does
# not build itself, since two of it run side by side): compute-sanitizer over the CUDA
# tests of the kernels (not the model-level tests: HF models under the sanitizer take hours).
#   memcheck   out-of-bounds and misaligned accesses, leaks, errors of the CUDA API
#   racecheck  shared-memory hazards, bf16 tests only (the hazards do not depend on the dtype).
#              It also reports hazards inside the tests' reference kernels (cuBLAS's nvjet GEMMs,
#              torch's argmax reduce_kernel): read the kernel names. (Restricting it to pagedkv's
#              kernels with --kernel-name made the sanitizer fail with an internal error.)
# Test groups: decode (paged decode attention, RoPE + KV write, copy_blocks), prefill (paged
# prefill attention), dense (SiLU*mul, norms, sampling, linear, advance_decode_rows), all.
# Serially the whole set takes over 10 minutes per tool on an H100, so --shards N splits the
# selected tests round-robin over N processes per tool (PAGEDKV_TEST_SHARD, tests/conftest.py),
# all running at once: the sanitizer's cost is mostly host-side, and the machines have 16+ cores.
# Each process is stopped after SANITIZE_TIMEOUT seconds (default 540), so a call returns its
# logs within a device call's limit.
# Logs go to $OUT (else ./results): sanitize_<tool>_<group>[_<shard>].log, and one summary line
# each in sanitize_summary.txt.
# Usage: scripts/gpu_sanitize.sh [--shards N] memcheck|racecheck|both [GROUP] [-- pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
SHARDS=1
if [ "${1:-}" = "--shards" ]; then SHARDS=${2:?--shards needs a count}; shift 2; fi
usage="usage: gpu_sanitize.sh [--shards N] memcheck|racecheck|both [decode|prefill|dense|all] [-- pytest args]"
TOOL=${1:?$usage}
GROUP=${2:-all}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
TIMEOUT=${SANITIZE_TIMEOUT:-540}

files_of() {
  case "$1" in
    decode) echo tests/test_paged_decode_attention.py tests/test_rope.py tests/test_copy_blocks.py ;;
    prefill) echo tests/test_paged_prefill_attention.py ;;
    dense) echo tests/test_activation.py tests/test_rms_norm.py tests/test_sampling.py \
             tests/test_linear.py tests/test_advance_decode_rows.py ;;
    all) echo "$(files_of decode) $(files_of prefill) $(files_of dense)" ;;
    *) echo "gpu_sanitize.sh: unknown group '$1' (decode, prefill, dense, all)" >&2; exit 2 ;;
  esac
}
filter_of() {  # pytest -k per tool
  case "$1" in
    memcheck) echo "not long_context or float16" ;;  # the longest contexts in one dtype: same code
    racecheck) echo "bfloat16 and not long_context" ;;
  esac
}
case "$TOOL" in
  memcheck|racecheck) TOOLS=$TOOL ;;
  both) TOOLS="memcheck racecheck" ;;
  *) echo "gpu_sanitize.sh: unknown tool '$TOOL' (memcheck, racecheck, both)" >&2; exit 2 ;;
esac
FILES=$(files_of "$GROUP") || exit 2
if [ "$(cat build/gpu-source.stamp 2>/dev/null)" != "$(scripts/source_stamp.sh)" ]; then
  echo "gpu_sanitize.sh: the installed pagedkv was not built from this tree's csrc (or not by" \
    "scripts/gpu_check.sh); run scripts/gpu_check.sh --no-tests --bench none first" >&2
  exit 2
fi
# In every pytest command line of this run (as its --basetemp), so that the stragglers stopped
# below are this run's own, not those of another gpu_sanitize.sh running beside it.
TAG=/tmp/pagedkv-sanitize-$$

# One sanitizer process over one shard of the selected tests; prints its summary line.
run_one() {  # tool shard log
  local tool=$1 shard=$2 log=$3
  # Without the caching allocator every tensor is its own allocation, so an access past its end
  # is caught instead of landing in a neighbouring cached block.
  # shellcheck disable=SC2086
  PAGEDKV_TEST_SHARD=$shard PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$TIMEOUT" \
    "$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20 \
    "$PY" -m pytest -m cuda -q -p no:cacheprovider --basetemp "$TAG/$tool-${shard%/*}" $FILES \
    -k "$(filter_of "$tool")" "${@:4}" > "$log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" = 124 ] && note=" TIMED OUT after ${TIMEOUT} s"
  echo "$tool $GROUP shard $shard: $(grep -c -E 'Race reported|Invalid|Internal Sanitizer Error' "$log") reports," \
       "$(grep -E '[0-9]+ (passed|failed)|no tests ran' "$log" | tail -1) |" \
       "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) (exit $rc)$note"
  return "$rc"
}

pids=()
for tool in $TOOLS; do
  for (( i = 0; i < SHARDS; i++ )); do
    run_one "$tool" "$i/$SHARDS" "$RESULTS/sanitize_${tool}_${GROUP}_${i}.log" "$@" \
      >> "$RESULTS/sanitize_summary.txt" &
    pids+=($!)
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# timeout stops the sanitizer, not always the pytest under it, which would keep GPU memory.
pkill -f -- "--basetemp $TAG/" 2>/dev/null
sort -o "$RESULTS/sanitize_summary.txt" "$RESULTS/sanitize_summary.txt"
{ echo "kernels named in race reports (count, kernel):"
  cat "$RESULTS"/sanitize_racecheck_*.log 2>/dev/null | grep -o "access at .*" |
    sed 's/^access at //; s/+0x[0-9a-f]*.*//' | sort | uniq -c; } >> "$RESULTS/sanitize_summary.txt"
cat "$RESULTS/sanitize_summary.txt"
exit $status
