#!/usr/bin/env bash
# The README's main command: set up (idempotent), then run the demo (GPU if present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
