"""Training metrics: console lines, TensorBoard scalars and ``metrics.jsonl`` (one JSON object per logged step).

Only the process that owns the logger writes (rank 0 by default); the numbers it writes are already reduced
over all ranks by the trainer. ``metrics.jsonl`` rows have at least ``step``, ``loss``, ``grad_norm``, ``lr``,
``tokens_per_s``, ``mfu`` and ``memory_gib``; validation rows have ``step``, ``val_loss`` and ``val_ppl``. Every row
also has ``time`` (Unix seconds when it was written) and ``attempt`` (which process of the run folder wrote it: a
resume replays the steps after its checkpoint, and :func:`hola_titan.metrics_records.read_metrics` keeps the last
attempt's row of each step). The file is strict JSON: a non-finite number is written as ``null``.

The console's step line ends with an estimate of the time left, ``eta 1h02m``: the steps left times the mean time of
a step over the last :data:`ETA_WINDOW` logged intervals of this process. The window starts at this process's first
logged step, so the first step's compilation (and a resume's start-up) is not in it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path

import torch

from hola_titan.metrics_records import METRICS_FILE, open_for_append, record_attempt

logger = logging.getLogger("hola_titan")

ETA_WINDOW = 20
"""Logged intervals whose mean step time the console's ``eta`` uses."""


class _CurrentStderrHandler(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is when a record is logged, not as it was at setup.

    Why: a caller that runs the trainer in its own process (a notebook, a test harness that swaps ``sys.stderr`` for a
    capture file and closes it afterwards) would otherwise leave a handler bound to a closed stream, and every later
    warning would print logging's own "I/O operation on closed file" traceback instead of the message.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102 (logging.StreamHandler's attribute)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ and setStream assign it; the property decides
        pass


def setup_logging(rank: int) -> None:
    """Log to stderr with the rank in every line (torchrun's ``--tee`` adds it itself, so then it is left out)."""
    handler = _CurrentStderrHandler()
    prefix = "" if "TORCHELASTIC_RUN_ID" in os.environ else f"[rank{rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hola_titan")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated device memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


class MetricsLogger:
    """Writes metric rows to the console, TensorBoard and ``<folder>/metrics.jsonl``.

    When enabled, it records this process as the folder's next attempt (``hola_titan/metrics_records.py``);
    ``start_step`` is the step the run starts after (the resumed checkpoint's, 0 from scratch) and ``total_steps``
    the last step (for the console's ``eta``; None: no estimate).
    """

    def __init__(self, folder: Path, *, enabled: bool, tensorboard: bool, tb_folder: str, start_step: int = 0,
                 total_steps: int | None = None):
        self.enabled = enabled
        self.jsonl = None
        self.writer = None
        self.attempt: int | None = None
        self.total_steps = total_steps
        self._marks: deque[tuple[int, float]] = deque(maxlen=ETA_WINDOW + 1)  # (step, monotonic time) of train rows
        if not enabled:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.attempt = record_attempt(folder, start_step=start_step)
        self.jsonl = open_for_append(folder / METRICS_FILE)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # An earlier attempt's events from this attempt's first step on are what this one replays: TensorBoard's
            # restart marker (purge_step) hides them, so no step shows two points.
            replaying = self.attempt > 1 or start_step > 0
            self.writer = SummaryWriter(log_dir=str(folder / tb_folder),
                                        purge_step=start_step + 1 if replaying else None)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        step = row["step"]
        record = {**row, "time": round(time.time(), 3), "attempt": self.attempt}
        # Strict JSON: NaN and inf (which json.dumps would write bare) become null.
        self.jsonl.write(json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        eta = None
        if "loss" in row:
            self._marks.append((step, time.monotonic()))
            eta = self.eta_seconds(step)
        logger.info(_format(row) + (f"  eta {format_duration(eta)}" if eta is not None else ""))

    def eta_seconds(self, step: int) -> float | None:
        """The steps left after ``step`` times the mean step time over the logged intervals in the window; None
        before this process has logged two training rows, at the last step, or without ``total_steps``."""
        if self.total_steps is None or step >= self.total_steps or len(self._marks) < 2:
            return None
        (first_step, first_time), (last_step, last_time) = self._marks[0], self._marks[-1]
        return (self.total_steps - step) * (last_time - first_time) / (last_step - first_step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def format_duration(seconds: float) -> str:
    """``1h02m``, ``5m07s`` or ``42s``."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    value = float(value) if isinstance(value, torch.Tensor) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _format(row: dict) -> str:
    parts = [f"step {row['step']:>6}"]
    fmt = {"loss": "{:.4f}", "val_loss": "{:.4f}", "val_ppl": "{:.2f}", "grad_norm": "{:.3f}", "lr": "{:.3e}",
           "tokens_per_s": "{:,.0f}", "mfu": "{:.2f}%", "memory_gib": "{:.2f} GiB"}
    for key, pattern in fmt.items():
        if key in row and row[key] is not None:
            value = row[key] * 100 if key == "mfu" else row[key]
            parts.append(f"{key} " + pattern.format(value))
    return "  ".join(parts)
