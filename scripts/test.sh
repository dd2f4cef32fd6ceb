#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the CPU test suite. GPU tests carry the `gpu`
# marker and are deselected here; run them on a GPU machine with `.venv/bin/python -m pytest -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -m "not gpu" "$@"
