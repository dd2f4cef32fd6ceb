"""Traces of training steps (``[profiling]``): ``torch.profiler`` on every rank, one traced step per window.

Each window of ``freq`` steps waits, records ``warmup`` steps that are dropped, then records one step and writes
``<dump_folder>/<traces_folder>/step-N/rank{R}.json.gz`` (a Chrome trace: CPU ops, and CUDA kernels and
collectives where there is a GPU; Perfetto opens it) and ``rank{R}.txt`` (the operators with the most self time).
Every rank writes its own, so a stall on one rank, or a collective that waits for another, is visible side by side.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from hola_titan.config import Profiling

logger = logging.getLogger(__name__)


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def step_profiler(config: Profiling, *, folder: Path, rank: int, device: torch.device, step_of: Callable[[], int]):
    """Yields an object whose ``step()`` the training loop calls after every step; a no-op when disabled.
    ``step_of()`` gives the training step a trace is named after."""
    if not config.enable:
        yield _NoProfiler()
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = device.type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof) -> None:
        out = folder / f"step-{step_of()}"
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(out / f"rank{rank}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        (out / f"rank{rank}.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40) + "\n")
        if rank == 0:
            logger.info("profiling: step %d traced to %s", step_of(), out)

    schedule = torch.profiler.schedule(wait=config.freq - config.warmup - 1, warmup=config.warmup, active=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write) as prof:
        yield prof
