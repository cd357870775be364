#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the test suite. CUDA tests are skipped
# on a machine without a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
