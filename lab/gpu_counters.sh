#!/usr/bin/env bash
# On a GPU machine, after scripts/gpu_check.sh has built pagedkv: hardware counters (Nsight
# Compute) of the kernels behind the open speed gaps, and paged decode attention's time over
# num_splits at W3's and W1's shapes (lab/kernel_counters.py says which kernels and why).
# Writes to $OUT (else ./results): counters.txt (ncu's details page per kernel, in the order the
# script prints), splits.md and splits_w1.md (the sweeps).
# Usage: lab/gpu_counters.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
status=0
"$PY" lab/kernel_counters.py sweep | tee "$RESULTS/splits.md" || status=1
"$PY" lab/kernel_counters.py sweep-w1 | tee "$RESULTS/splits_w1.md" || status=1
if [ -z "$NCU" ]; then
  echo "gpu_counters.sh: ncu not found" >&2; exit 1
fi
# --clock-control none: the clocks as every other measurement sees them (device METHOD.md).
"$NCU" --profile-from-start off --clock-control none --nvtx \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section WarpStateStats \
  "$PY" lab/kernel_counters.py counters > "$RESULTS/counters.txt" 2>&1 || status=1
grep -E "profiled, in order|^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Theoretical Occupancy|Stall Long|Warp Cycles Per Issued" \
  "$RESULTS/counters.txt" | head -200
exit $status
