#!/usr/bin/env bash
# Fetches, into .whl/ (ignored by git), the Python 3.12 wheels that the lent GPU machines lack,
# for the device tool to carry (it takes at most 64 MiB a call, working tree included):
#   .whl/nb/    nbconvert, ipykernel and their dependencies (examples/compare.ipynb on the GPU)
#   .whl/deps/  gguf (the default model), and FlashInfer's small dependencies
#   .whl/build/ scikit-build-core >= 0.11 and its dependencies (pyproject.toml needs it: PEP 639
#               license fields), in case a machine's image holds an older one
#   .whl/fi/    flashinfer-python (W3's FlashInfer column): its 62 MB wheel unpacked and packed again
#               as flashinfer.tar.xz (~18 MB; the wheel's deflate leaves its sources 3.5x larger
#               than xz does), so one call carries it with everything else
#   .whl/quant/ bitsandbytes, compressed-tensors (and its pydantic, loguru, psutil) and torchao:
#               the quantized checkpoints' loader packages (issue 33; ~48 MB: carry it without
#               .whl/fi, e.g. `carry: [".whl/quant", ".whl/deps"]`)
# On the device, scripts/gpu_check.sh installs them when .whl is carried (nbconvert and ipykernel
# into the system site, FlashInfer and the deps into /tmp/pagedkv-site on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
download() {  # download DIR [pip args...]
  local dir=$1; shift
  mkdir -p "$dir"
  "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$dir" "$@"
}
download .whl/nb nbconvert ipykernel nbclient
download .whl/build "scikit-build-core>=0.11"
download .whl/deps --no-deps gguf "apache-tvm-ffi<0.2,>=0.1.11" einops tabulate nvidia-ml-py
download .whl/quant --no-deps bitsandbytes compressed-tensors torchao pydantic pydantic-core \
  annotated-types typing-inspection loguru psutil
rm -rf .whl/fi_download .whl/fi && download .whl/fi_download --no-deps "flashinfer-python==0.7.2.post1"
mkdir -p .whl/fi .whl/fi_download/unpacked
(cd .whl/fi_download/unpacked && "$PY" -m zipfile -e ../*.whl . && tar -cf - . | xz -T0 -6 > ../../fi/flashinfer.tar.xz)
rm -rf .whl/fi_download
du -sh .whl/nb .whl/deps .whl/build .whl/quant .whl/fi
