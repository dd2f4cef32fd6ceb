"""The Triton kernels in Triton's interpreter on the CPU, each suite in its own process.

Triton picks the interpreter when a kernel is *defined* (``TRITON_INTERPRET=1`` at import), so the suites in
``tests/interpreter/`` run in a child pytest whose environment sets it; this process, and every other test in
it, keeps compiled-kernel semantics and its environment unchanged. A suite that collects nothing fails (pytest
exit 5), as does any failure inside it, whose report is shown here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# At least this many tests run in each suite (a suite that silently shrinks is a failure too).
SUITES = {"kernels_triton.py": 20, "fused_kernels.py": 8}


@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_passes_in_triton_s_interpreter(suite):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=*.py",
                           str(HERE / "interpreter" / suite)], cwd=HERE.parent, env=env, capture_output=True,
                          text=True, timeout=1500)
    report = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{suite} in the interpreter (exit {proc.returncode}):\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= SUITES[suite], f"{suite}: too few tests ran:\n{report}"
