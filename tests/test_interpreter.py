"""The Triton kernels in Triton's interpreter on the CPU, in child processes.

Triton picks the interpreter when a kernel is *defined* (``TRITON_INTERPRET=1`` at import), so the suites in
``tests/interpreter/`` run in child pytests whose environment sets it; this process, and every other test in
it, keeps compiled-kernel semantics and its environment unchanged. A shard that collects nothing fails (pytest
exit 5), as does any failure inside it, whose failures and short summary are shown here.

The suites run as shards of about equal time (one child each), so that pytest-xdist's workers run them side by
side; the least counts below are every test of the suites, so that a test no shard selects fails a count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# (suite, -k expression or None, at least this many tests pass): a shard that silently shrinks is a failure too.
# The continuation cases are about a third of kernels_triton.py's time, the launch candidates another third.
_CANDIDATES = "variants or dq_summed or dq_atomic or kept_cache or model_setting"
SHARDS = {  # the longest first (tests/conftest.py starts this module's tests before the others)
    "kernels_triton-rest": ("kernels_triton.py", f"not continues and not ({_CANDIDATES})", 26),
    "kernels_triton-candidates": ("kernels_triton.py", _CANDIDATES, 16),
    "fused_kernels": ("fused_kernels.py", None, 15),
    "kernels_triton-continues": ("kernels_triton.py", "continues", 16),
}
REPORT_CHARS = 12000


def failure_report(output: str, limit: int = REPORT_CHARS) -> str:
    """What a reader needs of a failed child: from pytest's FAILURES (or ERRORS) section to the end (tracebacks,
    then the short summary); where that is longer than ``limit``, its start (the first failure) and its end (the
    short summary). Without such a section (a crash before any test ran), the output's end."""
    match = re.search(r"^=+ (FAILURES|ERRORS) =+$", output, flags=re.M)
    report = output[match.start():] if match else output
    if len(report) <= limit:
        return report
    if not match:
        return report[-limit:]
    head, tail = report[:limit // 2], report[-limit // 2:]
    return f"{head}\n[... {len(report) - limit} characters left out ...]\n{tail}"


@pytest.mark.parametrize("shard", list(SHARDS))
def test_suites_pass_in_triton_s_interpreter(shard):
    pytest.importorskip("triton")
    suite, select, least = SHARDS[shard]
    # One intra-op thread: the shapes are tiny, and the shards run side by side on the CI machine's two cores.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    # -rfEp: a short summary line for every failed, erroring and passed test (counted below), and no section of
    # passed tests' captured output.
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEp", "-p", "no:cacheprovider", "-o", "python_files=*.py",
           str(HERE / "interpreter" / suite), *(["-k", select] if select else [])]
    proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{shard} (exit {proc.returncode}):\n{failure_report(output)}"
    passed = len(re.findall(rf"^PASSED \S*interpreter/{re.escape(suite)}::", proc.stdout, flags=re.M))
    assert passed >= least, f"{shard}: {passed} tests passed, expected at least {least}:\n{output[-REPORT_CHARS:]}"


def test_a_failed_child_s_report_shows_its_failures_not_its_log():
    log = "\n".join(f"DEBUG    torch.__trace:utils.py:{i} " for i in range(2000))
    output = ("....F\n=================================== FAILURES ===================================\n"
              "___ test_x ___\nE   AssertionError: dsink: max abs error\n" + log +
              "\n=========================== short test summary info ============================\n"
              "FAILED tests/interpreter/kernels_triton.py::test_x - AssertionError: dsink\n1 failed, 4 passed\n")
    report = failure_report(output)
    assert len(report) <= REPORT_CHARS + 100
    assert "AssertionError: dsink: max abs error" in report  # the first failure, from its start
    assert "FAILED tests/interpreter/kernels_triton.py::test_x" in report and report.endswith("4 passed\n")
    assert failure_report("Traceback: ImportError\n") == "Traceback: ImportError\n"
