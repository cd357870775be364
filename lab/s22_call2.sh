#!/usr/bin/env bash
# Session 22, call 2: the committed tree (HEAD) built in /tmp/clean; W2 (pagedkv only), the
# notebook on the W1 shape, the profiler CLI's plot on CUDA.
set -x
export NCCL_NVLS_ENABLE=0
HEAD_REV=${1:?rev}
rm -rf /tmp/clean && mkdir -p /tmp/clean && git archive "$HEAD_REV" | tar -x -C /tmp/clean && cp -r .whl /tmp/clean/
cd /tmp/clean
BENCH_THROUGHPUT_ARGS="--no-hf" timeout 200 scripts/gpu_check.sh --no-tests --bench throughput 2>&1 | tail -25
python3 -m pip install -q --no-index --disable-pip-version-check --find-links .whl/nb nbconvert ipykernel nbclient 2>&1 | tail -2
export PYTHONPATH=/tmp/pagedkv-site
PAGEDKV_NOTEBOOK_MODEL=w1 timeout 300 python3 -m jupyter nbconvert --to notebook --execute examples/compare.ipynb --output-dir "$OUT" --output compare_h100.ipynb 2>&1 | tail -5
timeout 150 python3 -m pagedkv.tools.profile --model w2 --batch 8 --prompt 128 --new 16 --compare hf --out /tmp/prof 2>&1 | tail -60
cp /tmp/prof/profile.png /tmp/prof/*.json "$OUT"/ 2>/dev/null; ls -la "$OUT"
