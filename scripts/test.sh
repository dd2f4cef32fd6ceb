#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh), lint with ruff, and run the CPU test suite. GPU tests carry the
# `gpu` marker and are deselected here; run them on a GPU machine with `.venv/bin/python -m pytest -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The configured lint rules ([tool.ruff.lint] in pyproject.toml) first: a failure stops before the tests.
.venv/bin/ruff check .
# --durations: the slowest tests in every log, to keep the suite under its 20 minutes.
exec .venv/bin/python -m pytest -q -m "not gpu" --durations=15 "$@"
