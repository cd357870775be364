#!/usr/bin/env bash
# On a GPU machine: the launch plans (steps in flight x warps a 16-row tile) of the 4-bit
# tensor-core GEMV's scaled sums (int4 groups of 128), each on W1's four shapes at 1 and 8 rows
# (benchmarks/bench_quant_linear.py --formats int4), to pick each shape's plan from one machine's
# numbers. lab/experiments/int4_plan_sweep.patch (lab only) lets PAGEDKV_LAB_4BIT_PLAN=UxS force
# a plan on every matrix, qkv's included. Builds the patched tree, runs the tree's own plan
# ("default") and each forced one, then reverses the patch and rebuilds the tree.
# Writes to $OUT (else ./results): plans.md (the int4 rows of each run).
# Usage: lab/int4_plan_sweep.sh [PLAN ...]   (default: 1x8 1x16 2x4 2x8 2x16 4x4 4x8)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PLANS=("$@")
[ ${#PLANS[@]} -gt 0 ] || PLANS=(1x8 1x16 2x4 2x8 2x16 4x4 4x8)
PATCH=lab/experiments/int4_plan_sweep.patch
git apply "$PATCH" || exit 1
status=0
OUT=$RESULTS/build scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1
if [ $status -eq 0 ]; then
  for plan in default "${PLANS[@]}"; do
    echo "== plan $plan"
    if [ "$plan" = default ]; then
      env -u PAGEDKV_LAB_4BIT_PLAN python3 benchmarks/bench_quant_linear.py --formats int4 --rows 1,8 \
        --out "$RESULTS/$plan"
    else
      PAGEDKV_LAB_4BIT_PLAN=$plan python3 benchmarks/bench_quant_linear.py --formats int4 --rows 1,8 \
        --out "$RESULTS/$plan"
    fi 2>&1 | grep -E "\| int4 \||Error|error"
  done | tee "$RESULTS/plans.md"
fi
git apply -R "$PATCH"
OUT=$RESULTS/rebuild scripts/gpu_check.sh --no-tests --bench none > /dev/null 2>&1 || status=1
exit $status
