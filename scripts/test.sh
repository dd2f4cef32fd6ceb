#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh), lint with ruff, and run the CPU test suite. GPU tests carry the
# `gpu` marker and are deselected here; run them on a GPU machine with `.venv/bin/python -m pytest -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The configured lint rules ([tool.ruff.lint] in pyproject.toml) first: a failure stops before the tests.
.venv/bin/ruff check .
# Two pytest-xdist workers (the CI machine's two cores; much of the suite waits on torchrun start-ups and child
# processes), tests grouped by their xdist_group marks. --durations: the slowest tests in every log, to keep the
# suite under its 15 minutes on 2 cores.
exec .venv/bin/python -m pytest -q -m "not gpu" -n 2 --dist loadgroup --durations=15 "$@"
