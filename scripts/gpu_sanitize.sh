#!/usr/bin/env bash
# On a GPU machine, after scripts/gpu_check.sh has built pagedkv: compute-sanitizer over the CUDA
# tests of every kernel (not the model-level tests: HF models under the sanitizer take hours).
#   memcheck   out-of-bounds and misaligned accesses, leaks, errors of the CUDA API
#   racecheck  shared-memory hazards (the kernels that use shared memory), bf16 subset
# Logs go to $OUT (else ./results): sanitize_<tool>.log, and one summary line per tool.
# Usage: scripts/gpu_sanitize.sh [memcheck|racecheck|all] [-- extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
TOOL=${1:-all}
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
KERNEL_TESTS=(tests/test_paged_attention.py tests/test_paged_prefill_attention.py tests/test_rope.py
              tests/test_copy_blocks.py tests/test_activation.py tests/test_norm.py
              tests/test_sampling.py tests/test_linear.py)
status=0

run() {  # run TOOL -k EXPR
  local tool=$1 expr=$2 log="$RESULTS/sanitize_$1.log"
  shift 2
  # The allocator's cached blocks would hide out-of-bounds accesses inside them: allocate each
  # tensor on its own.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" --error-exitcode 1 \
    --print-limit 20 "$PY" -m pytest -m cuda -q -p no:cacheprovider "${KERNEL_TESTS[@]}" \
    -k "$expr" "$@" > "$log" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || status=1
  echo "$tool: $(grep -E 'passed|failed|no tests ran' "$log" | tail -1) | $(grep 'ERROR SUMMARY' "$log" | tail -1) (exit $rc)" | tee -a "$RESULTS/sanitize_summary.txt"
}

shift_args=("$@")
if [ "$TOOL" = memcheck ] || [ "$TOOL" = all ]; then
  # Every dtype and shape of the kernel tests; the longest contexts only in fp16 (the same code).
  run memcheck "not long_context or float16" "${shift_args[@]}"
fi
if [ "$TOOL" = racecheck ] || [ "$TOOL" = all ]; then
  run racecheck "bfloat16 and not long_context" "${shift_args[@]}"
fi
exit $status
