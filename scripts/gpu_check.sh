#!/usr/bin/env bash
# On a GPU machine (H100/H200): build pagedkv against the torch installed there, run the `cuda`
# tests, then the benchmarks, and write what happened under $OUT (the device tool's results
# folder), else $RESULTS_DIR, else ./results:
#   summary.md     build info, test summary line, each benchmark's table
#   gpu_check.log  everything printed (environment, build, tests, benchmarks)
#   *.png          the benchmarks' plots
# Usage: scripts/gpu_check.sh [--no-tests] [--bench all|none|NAME[,NAME...]] [-- PYTEST_ARGS]
#   NAME is a benchmark file's stem without "bench_" (e.g. norm, attention). Extra arguments of
#   one benchmark come from BENCH_<NAME>_ARGS, e.g. BENCH_GENERATE_ARGS="--batches 1,8".
# With a .whl folder (scripts/device_wheels.sh, carried along) it installs those wheels first.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS_DIR:-results}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python3}
RUN_TESTS=1
BENCH=all
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tests) RUN_TESTS=0 ;;
    --bench) BENCH=$2; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

LOG="$RESULTS/gpu_check.log"
SUMMARY="$RESULTS/summary.md"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 PAGEDKV_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export PAGEDKV_CUDA_ARCHS=${PAGEDKV_CUDA_ARCHS:-90}  # the machine's own arch: half the compile
# The lent GPU machines set CXX=/opt/gcc/bin/g++, a gcc that links libstdc++ statically; an
# extension holding its own libstdc++ beside torch's shared one crashes formatting a number into
# an error message (two copies of the locale facets). Build with the system compiler instead.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"

# Wheels carried from the dev machine (scripts/device_wheels.sh; the device tool's `carry: [".whl"]`):
# the notebook's nbconvert/ipykernel for tests/test_notebook.py, gguf, FlashInfer for W3's column,
# bitsandbytes / compressed-tensors / torchao (.whl/quant, carried apart: `carry: [".whl/quant",
# ".whl/deps"]`, the 64 MiB a call takes does not hold it beside FlashInfer).
if [ -d .whl ]; then
  echo "== carried wheels (.whl)"
  SITE=/tmp/pagedkv-site
  mkdir -p "$SITE"
  if [ -d .whl/nb ]; then
    "$PY" -m pip install -q --no-index --disable-pip-version-check --find-links .whl/nb \
      nbconvert ipykernel nbclient || echo "gpu_check: the notebook wheels did not install"
  fi
  if [ -f .whl/fi/flashinfer.tar.xz ]; then tar -xJf .whl/fi/flashinfer.tar.xz -C "$SITE"; fi
  if ls .whl/deps/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" \
      .whl/deps/*.whl || echo "gpu_check: .whl/deps did not install"
  fi
  if ls .whl/quant/*.whl > /dev/null 2>&1; then  # the quantized checkpoints' loader packages
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" \
      .whl/quant/*.whl || echo "gpu_check: .whl/quant did not install"
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  for package in bitsandbytes compressed_tensors torchao; do
    "$PY" -c "import $package; print('$package', $package.__version__)" 2>&1 | tail -1
  done
fi

echo "== build"
# pyproject.toml needs scikit-build-core >= 0.11: the carried wheels upgrade an older one.
if [ -d .whl/build ]; then
  "$PY" -m pip install -q --no-index --disable-pip-version-check --find-links .whl/build \
    --upgrade "scikit-build-core>=0.11" || echo "gpu_check: .whl/build did not install"
fi
start=$(date +%s)
# A warm machine keeps the last call's build folder, and the tree copied over keeps the files' own
# modification times: a source changed back (a patch applied in one call, not in the next) is then
# older than its object and ninja would not rebuild it. Touch every source whose content differs
# from what the last build here was made of.
mkdir -p build
find csrc CMakeLists.txt pyproject.toml -type f -print0 | sort -z | xargs -0 sha1sum > build/gpu-sources.now
if [ -f build/gpu-sources.built ]; then
  diff build/gpu-sources.built build/gpu-sources.now | awk '/^> /{print $3}' | xargs -r touch
fi
# A build folder of its own: a CMake cache configured with another compiler would be reused.
if ! "$PY" -m pip install --no-build-isolation --no-deps --quiet --disable-pip-version-check \
    -Cbuild-dir="build/gpu-{wheel_tag}" .; then
  echo "# gpu_check: BUILD FAILED (see gpu_check.log)" > "$SUMMARY"
  exit 1
fi
info=$(cd /tmp && "$PY" -c "import pagedkv; print(pagedkv.build_info)")
scripts/source_stamp.sh > build/gpu-source.stamp  # what the installed build is of: gpu_sanitize.sh
mv build/gpu-sources.now build/gpu-sources.built
echo "built in $(( $(date +%s) - start )) s: $info"
{ echo "# gpu_check $(date -u +%FT%TZ)"; echo; echo "- device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"; echo "- build: $info"; } > "$SUMMARY"

status=0
if [ "$RUN_TESTS" = 1 ]; then
  echo "== tests (-m cuda)"
  # Run from the installed package: tests import pagedkv, not the source folder.
  # Test paths among the arguments (tests/x.py, tests/x.py::case) replace the whole folder:
  # pytest would otherwise run the folder and those files both (sessions 25 and 29 ran the whole
  # suite that way, past the call's limit or out of memory).
  # A -q among them is dropped: this line passes one, and pytest -qq prints no count line for the
  # summary (session 34's call 1 lost its count that way).
  TARGET=(tests)
  ARGS=()
  for arg in "${PYTEST_ARGS[@]}"; do
    [[ "$arg" == tests/* ]] && TARGET=()
    [ "$arg" = -q ] || ARGS+=("$arg")
  done
  "$PY" -m pytest -m cuda -q -p no:cacheprovider "${TARGET[@]}" "${ARGS[@]}" | tee "$RESULTS/.pytest.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || status=1
  # pytest's count line (not the last line: -rf or a doubled -q put others after it or drop it)
  counts=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)" "$RESULTS/.pytest.txt" | tail -1)
  echo "- cuda tests: ${counts:-no count line printed (pytest -qq?)} (exit $rc)" >> "$SUMMARY"
  rm -f "$RESULTS/.pytest.txt"
fi

if [ "$BENCH" != none ]; then
  for script in benchmarks/bench_*.py; do
    name=$(basename "$script" .py); name=${name#bench_}
    if [ "$BENCH" != all ] && [[ ",$BENCH," != *",$name,"* ]]; then continue; fi
    args_var="BENCH_${name^^}_ARGS"
    read -r -a extra <<< "${!args_var:-}"
    echo "== benchmark $name ${extra[*]}"
    if "$PY" "$script" --out "$RESULTS" "${extra[@]}"; then
      { echo; echo "## $name"; echo; cat "$RESULTS/bench_$name.md" 2>/dev/null; } >> "$SUMMARY"
      rm -f "$RESULTS/bench_$name.md"
    else
      status=1; echo "- benchmark $name FAILED" >> "$SUMMARY"
    fi
  done
fi
echo "== summary"; cat "$SUMMARY"
exit $status
