#!/usr/bin/env bash
# Fetches, into .whl/ (ignored by git), the Python 3.12 wheels that the lent GPU machines lack,
# for the device tool to carry (it takes at most 64 MiB a call, working tree included):
#   .whl/nb/    nbconvert, ipykernel and their dependencies (examples/compare.ipynb on the GPU)
#   .whl/deps/  gguf (the default model), and FlashInfer's small dependencies
#   .whl/fi/    flashinfer-python (62 MB, W3's FlashInfer column), split in two halves, part_aa and
#               part_ab, to carry in two consecutive calls (the machine stays warm between them)
# On the device:
#   pip install --no-index --find-links .whl/nb nbconvert ipykernel nbclient
#   call 1: mkdir -p /root/fi && cp .whl/fi/part_aa /root/fi/
#   call 2: cat /root/fi/part_aa .whl/fi/part_ab > /root/fi/$(cat .whl/fi/NAME) &&
#           pip install --no-deps /root/fi/$(cat .whl/fi/NAME) .whl/deps/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
download() {  # download DIR [pip args...]
  local dir=$1; shift
  mkdir -p "$dir"
  "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$dir" "$@"
}
download .whl/nb nbconvert ipykernel nbclient
download .whl/deps --no-deps gguf "apache-tvm-ffi<0.2,>=0.1.11" einops tabulate nvidia-ml-py
rm -rf .whl/fi_download && download .whl/fi_download --no-deps "flashinfer-python==0.7.2.post1"
mkdir -p .whl/fi
wheel=$(ls .whl/fi_download/*.whl)
basename "$wheel" > .whl/fi/NAME
split -n 2 "$wheel" .whl/fi/part_
rm -rf .whl/fi_download
du -sh .whl/nb .whl/deps .whl/fi
