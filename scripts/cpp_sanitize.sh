#!/usr/bin/env bash
# Builds the torch-free cache core (csrc/cache/) with tests/cpp/test_cache_manager.cpp under
# AddressSanitizer + UndefinedBehaviorSanitizer and runs it. Any sanitizer report fails the run
# (halt_on_error, non-zero exit), as does a failed check. Run by scripts/test.sh before pytest.
# Arguments go to the test program: [random runs] [operations per run].
set -euo pipefail
cd "$(dirname "$0")/.."

CXX=${CXX:-}
if [ -z "$CXX" ]; then
  for c in g++ clang++; do
    if command -v "$c" >/dev/null; then CXX=$c; break; fi
  done
fi
[ -n "$CXX" ] || { echo "cpp_sanitize: no C++ compiler (g++ or clang++) found" >&2; exit 1; }

BUILD=${PAGEDKV_SANITIZE_BUILD:-build/sanitize}
mkdir -p "$BUILD"
BIN="$BUILD/test_cache_manager"
SOURCES=(tests/cpp/test_cache_manager.cpp csrc/cache/block_allocator.cpp csrc/cache/cache_manager.cpp
         csrc/cache/step_metadata.cpp)
# -fno-sanitize-recover: a UBSan finding aborts instead of printing and going on.
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all)
# One compile per source, in parallel (most of this script's time), then one link.
rm -f "$BUILD"/*.o
pids=()
for src in "${SOURCES[@]}"; do
  "$CXX" "${FLAGS[@]}" -Wall -Wextra -Icsrc -c "$src" -o "$BUILD/$(basename "$src" .cpp).o" & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"$CXX" "${FLAGS[@]}" "$BUILD"/*.o -o "$BIN"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
"$BIN" "$@"
