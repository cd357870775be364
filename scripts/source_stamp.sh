#!/usr/bin/env bash
# Prints a hash of what the extension is built from (csrc, the build files). gpu_check.sh stores
# it beside its build; gpu_sanitize.sh compares, so it never runs over a build of other sources
# (a warm device machine keeps the last call's build, e.g. gpu_ab.sh's patched side).
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc CMakeLists.txt pyproject.toml -type f -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1
