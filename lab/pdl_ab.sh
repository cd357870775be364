#!/usr/bin/env bash
# A/B of programmatic dependent launch (csrc/kernels/dependent_launch.cuh) on one build: W1
# (batches 1/8/32, pagedkv only) and W2 (pagedkv only) with PAGEDKV_PDL=0 and =1, alternating
# for N rounds, each run its own process. Needs pagedkv built on this machine first
# (scripts/gpu_check.sh --no-tests --bench none).
#   lab/pdl_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
for round in $(seq "$ROUNDS"); do
  for pdl in 0 1; do
    echo "== round $round, PAGEDKV_PDL=$pdl"
    PAGEDKV_PDL=$pdl python3 benchmarks/bench_generate.py --batches 1,8,32 --pagedkv-only 2>&1 \
      | grep "pagedkv CUDA graphs |"
    PAGEDKV_PDL=$pdl python3 benchmarks/bench_throughput.py --no-hf 2>&1 | grep "^pagedkv.LLM:"
  done
done
