"""Training metrics: console lines, TensorBoard scalars and ``metrics.jsonl`` (one JSON object per logged step).

Only the process that owns the logger writes (rank 0 by default); the numbers it writes are already reduced
over all ranks by the trainer. ``metrics.jsonl`` rows have at least ``step``, ``loss``, ``grad_norm``, ``lr``,
``tokens_per_s``, ``mfu`` and ``memory_gib``; validation rows have ``step``, ``val_loss`` and ``val_ppl``. The file is
strict JSON: a non-finite number is written as ``null``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from pathlib import Path

import torch

logger = logging.getLogger("hola_titan")


def setup_logging(rank: int) -> None:
    """Log to stderr with the rank in every line (torchrun's ``--tee`` adds it itself, so then it is left out)."""
    handler = logging.StreamHandler(sys.stderr)
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
    """Writes metric rows to the console, TensorBoard and ``<folder>/metrics.jsonl``."""

    def __init__(self, folder: Path, *, enabled: bool, tensorboard: bool, tb_folder: str):
        self.enabled = enabled
        self.jsonl = None
        self.writer = None
        if not enabled:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(folder / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(folder / tb_folder))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        step = row["step"]
        # Strict JSON: NaN and inf (which json.dumps would write bare) become null.
        self.jsonl.write(json.dumps({k: _plain(v) for k, v in row.items()}, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        logger.info(_format(row))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


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
