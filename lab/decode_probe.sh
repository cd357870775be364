#!/usr/bin/env bash
# On a GPU machine: paged decode attention's kernel variants timed side by side with
# lab/decode_probe.cu (no torch, no extension build). A = the tree's csrc; each VARIANT a patch,
# or patches joined by "+", applied to a copy of csrc. All binaries build in parallel (~1 min),
# then run in turn, --rounds N times (A, B1, B2, A, B1, B2, ...): a difference that holds in every
# round is not the machine drifting. Extra probe arguments (e.g. --splits 1) follow "--".
# Prints the table and writes it to $OUT/decode_probe.md (else ./results).
# Usage: lab/decode_probe.sh [--rounds N] [VARIANT...] [-- PROBE_ARGS]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
ROUNDS=1
if [ "${1:-}" = "--rounds" ]; then ROUNDS=${2:?--rounds needs a count}; shift 2; fi
VARIANTS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VARIANTS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# The binaries stay in $WORK/NAME/probe (A, B1, ...) for a later ncu run in the same call.
WORK=${DECODE_PROBE_DIR:-/tmp/decode_probe}
rm -rf "$WORK"
mkdir -p "$WORK"

build() {  # NAME PATCHES: a copy of csrc with the patches, and its probe binary
  local dir=$WORK/$1 p
  mkdir -p "$dir"
  cp -r csrc "$dir/csrc"
  for p in $(tr '+' ' ' <<< "$2"); do
    patch -s -p1 -d "$dir" < "$p" || { echo "decode_probe.sh: $p does not apply" >&2; return 1; }
  done
  "$NVCC" -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 --use_fast_math -lineinfo \
    --expt-relaxed-constexpr -I"$dir/csrc" -o "$dir/probe" lab/decode_probe.cu \
    > "$dir/build.log" 2>&1 || { cat "$dir/build.log" >&2; return 1; }
}

NAMES=(A)
build A "" &
for i in "${!VARIANTS[@]}"; do
  NAMES+=("B$((i + 1))")
  build "B$((i + 1))" "${VARIANTS[$i]}" &
done
wait
{
  echo "# decode_probe: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "A: the tree's csrc$(for i in "${!VARIANTS[@]}"; do printf '; B%d: %s' $((i + 1)) "${VARIANTS[$i]}"; done)"
  echo
  echo "| side | batch x context | splits | us | GB/s of K/V | max abs diff vs fp32 |"
  echo "|---|---|---|---|---|---|"
  for (( r = 0; r < ROUNDS; r++ )); do
    for n in "${NAMES[@]}"; do
      if [ -x "$WORK/$n/probe" ]; then "$WORK/$n/probe" "$n" "$@"; else echo "| $n | build failed | | | | |"; fi
    done
  done
} | tee "$RESULTS/decode_probe.md"
