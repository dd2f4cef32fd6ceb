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
# Byte-compiled here, not by pip: where PYTHONDONTWRITEBYTECODE is set (it is on the 2-core machine the suite is
# timed on), no process writes a .pyc at import, so without them every process of the suite compiled every module
# it imported (the suite took 17 minutes instead of 12, 2026-12-02; 24.5 instead of 13.6 on 2026-12-06). pip
# compiles one file at a time (torch alone: 27 s); compileall -j 0 uses every core, and also compiles this
# project's own modules, which an editable install leaves as sources.
compiled=0
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile "${HOLA_TORCH_SPEC:-torch==2.13.0}"
  compiled=1
fi
stamp=.venv/.hola_titan_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e '.[dev]'
  compiled=1
fi
if [ "$compiled" = 1 ]; then
  # Exit status 1 only says that some file did not compile: packages ship sources for other Python versions
  # (torch's py312_intrinsics.py under 3.11, templates) that pip's own compile skipped just as silently, so their
  # listing is not shown; any other status (killed, a crash) stops here, before the stamp is written.
  # Left out, a third of the files and 11 of the 31 s (2 cores, 2026-12-07): packages' own test folders, pip, and
  # transformers' model folders other than auto and llama, which nothing here imports; a module imported from them
  # anyway is compiled by the process that imports it, as before.
  rc=0
  .venv/bin/python -m compileall -q -j 0 -x '/(tests?|pip)/|/transformers/models/(?!(auto|llama)/)' \
    $(.venv/bin/python -c 'import sysconfig; p = sysconfig.get_paths(); print(*sorted({p["purelib"], p["platlib"]}))') \
    > /dev/null || rc=$?
  [ "$rc" -le 1 ] || { echo "error: compileall of the environment's packages exited $rc" >&2; exit "$rc"; }
  touch "$stamp"
fi
# The project's sources change between runs: compileall rewrites only what changed (a fraction of a second). A
# file that does not compile is listed and stops the set-up.
.venv/bin/python -m compileall -q -j 0 hola_titan tests scripts
