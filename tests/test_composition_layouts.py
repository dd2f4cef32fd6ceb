"""The four- and eight-GPU layouts of ``scripts/composition_run.py`` (issue 55) at their own degrees on CPU (gloo),
with the debug model's widths (``--tiny``): each trains and reproduces the one-process losses of the same batch.

Every layout's overrides are the script's own (``Layout.overrides(tiny=True)``), so a layout that the GPU run would
refuse at start-up (degrees, batch, checkpointing) fails here first. One torchrun launch per process count trains
all its layouts; both sides compute in fp32, so the losses agree to reduction order (1e-5 relative, as
tests/test_parallel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import run_parallel_runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from composition_run import MODES  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_composition_layouts")
STEPS = 2


def _tiny_runs() -> dict[int, dict[str, list[str]]]:
    """Process count -> {layout name: trainer overrides} for the layouts of the four- and eight-GPU modes that
    differ at tiny widths: float8 needs a GPU, the 7B-width one-GPU stand-in has no parity reference, and 7B with
    FSDP 8 is 1.3B's FSDP 8 once both are the debug model (8 processes on 2 cores cost about 20 s a run)."""
    runs: dict[int, dict[str, list[str]]] = {}
    seen = set()
    for mode in ("gpu4", "gpu8"):
        for layout in MODES[mode]():
            if "--float8.enable" in layout.flags or layout.name == "7B_w4_1gpu":
                continue
            overrides = ("--job.config_file", str(layout.config_path(tiny=True)),
                         *layout.overrides(steps=STEPS, tiny=True))
            if overrides not in seen:
                seen.add(overrides)
                runs.setdefault(layout.nproc, {})[layout.name] = list(overrides)
    return runs


@pytest.mark.slow
def test_four_and_eight_gpu_layouts_train_like_one_process(tmp_path):
    runs = _tiny_runs()
    assert sorted(runs) == [1, 4, 8]
    assert sorted(runs[8]) == ["1.3B_fsdp2_tp2_cp2", "1.3B_fsdp4_cp2", "1.3B_fsdp8", "1.3B_hsdp2x4"]
    results = {}
    for nproc, named in runs.items():
        results.update(run_parallel_runs(tmp_path / f"n{nproc}", nproc, named))
    for name, got in results.items():
        assert isinstance(got, dict), f"{name}: {got}"
        assert len(got["losses"]) == STEPS, name
    reference = results["1.3B_1gpu"]["losses"]
    for name, got in results.items():
        assert got["losses"] == pytest.approx(reference, rel=1e-5), name
