"""The Triton kernels in Triton's interpreter on the CPU, in a child process.

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
# At least this many tests pass in each suite (a suite that silently shrinks is a failure too).
SUITES = {"kernels_triton.py": 20, "fused_kernels.py": 8}


def test_suites_pass_in_triton_s_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    # One child for both suites (one start-up of torch and Triton); -rA lists every passed test by file.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o",
                           "python_files=*.py", *(str(HERE / "interpreter" / suite) for suite in SUITES)],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1500)
    report = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"the interpreter suites (exit {proc.returncode}):\n{report}"
    for suite, least in SUITES.items():
        passed = len(re.findall(rf"^PASSED \S*interpreter/{re.escape(suite)}::", proc.stdout, flags=re.M))
        assert passed >= least, f"{suite}: {passed} tests passed, expected at least {least}:\n{report}"
