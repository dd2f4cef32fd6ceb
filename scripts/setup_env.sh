#!/usr/bin/env bash
# Create (or update) the project-local virtual environment .venv and install hola-titan into it, editable,
# with its test dependencies. Idempotent: a second run only checks what is there.
#   HOLA_PYTHON       interpreter to build the venv from (default: python3; needs 3.11+)
#   HOLA_TORCH_SPEC   torch requirement installed first when the venv has no torch (default: torch==2.13.0);
#                     the project supports torch 2.11 through 2.14.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${HOLA_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python 3.11+ required" >&2; exit 1; }
  "$PY" -m venv .venv
fi
# pip byte-compiles every module it installs (torch: 27 s of the 2-core machine's time; 6 s with --no-compile).
# Kept: where PYTHONDONTWRITEBYTECODE is set (it is on the 2-core machine the suite is timed on), no process
# writes a .pyc at import, so without pip's every process of the suite compiled every module it imported (the
# suite took 17 minutes instead of 12, 2026-12-02).
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${HOLA_TORCH_SPEC:-torch==2.13.0}"
fi
stamp=.venv/.hola_titan_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
  touch "$stamp"
fi
