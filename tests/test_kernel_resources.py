"""``scripts/kernel_resources.py``: a kernel of a shipped plan compiled for sm_90a on this CPU, its resources read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[1]


def test_a_planned_kernel_compiles_for_hopper_here_and_reports_its_resources(tmp_path):
    out = tmp_path / "rstd.json"
    result = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                             "--kernel", "_rstd_kernel", "--sweep", "BR=16,32", "--warps", "4", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["BR"] for r in rows] == [16, 32] and all("error" not in r for r in rows), rows
    # A row reduction: a few dozen registers, no spills, a little shared memory for the reduction, no wgmma.
    assert all(0 < r["registers"] < 128 and r["stack_bytes"] == 0 and r["wgmma"] == 0 for r in rows), rows
    assert rows[1]["registers"] >= rows[0]["registers"]  # twice the rows per program


def test_an_unknown_kernel_or_constexpr_is_one_line_naming_it():
    bad = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                          "--kernel", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--kernel: plan hola/d128/h2/float32/plain has no kernel 'nope'" in bad.stderr
    bad = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                          "--kernel", "_rstd_kernel", "--sweep", "R=1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--sweep: 'R' is not a constexpr argument of _rstd_kernel" in bad.stderr
