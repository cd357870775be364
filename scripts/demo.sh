#!/usr/bin/env bash
# The README's main command: set up (idempotent), then run the generation demo on the embedded
# default model, SmolLM2-135M-Instruct (GPU if present, else CPU), HF generate and pagedkv side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/generate.py "$@"
