#!/usr/bin/env bash
# The README's test command: set up (idempotent), run the C++ cache core under ASan/UBSan, then
# the test suite. CUDA tests are skipped on a machine without a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/cpp_sanitize.sh
exec .venv/bin/python -m pytest -q "$@"
