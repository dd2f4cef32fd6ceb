"""The run folder's metric files as records: ``metrics.jsonl`` and ``attempts.jsonl``, written and read back.

Standard library only, so that scripts which read a run's metrics without training (``scripts/ablate_small.py``,
``scripts/replicate_small.py``) load this file without importing torch.

Every process that trains in a run folder is one **attempt**: 1 for the first, one more for each later one (a
resume, or a start from step 0 in a folder that already has records). Each appends one line to
``<folder>/attempts.jsonl`` (``attempt``, ``time`` in Unix seconds, ``start_step``: the step it resumed after, 0
for a start from scratch, ``host``, ``pid``), and every ``metrics.jsonl`` record it writes carries ``attempt`` and
``time``. A resumed attempt replays the steps after its checkpoint, so the file holds those steps twice: a reader
keeps the last attempt's record of each step with :func:`read_metrics` (:func:`latest_records`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

ATTEMPTS_FILE = "attempts.jsonl"
METRICS_FILE = "metrics.jsonl"


def open_for_append(path: Path):
    """``path`` opened for appending lines (line-buffered). A last line that a kill cut short is ended first, so the
    next record starts a line of its own instead of joining the cut one (both would then be unreadable)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return open(path, "a", buffering=1, encoding="utf-8")


def record_attempt(folder: Path, *, start_step: int) -> int:
    """Append this process's start to ``<folder>/attempts.jsonl`` and return its attempt number (one more than the
    lines already there: a line cut by a kill still counts, that attempt ran)."""
    path = folder / ATTEMPTS_FILE
    earlier = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    attempt = sum(1 for line in earlier if line.strip()) + 1
    with open_for_append(path) as f:
        f.write(json.dumps({"attempt": attempt, "time": round(time.time(), 3), "start_step": start_step,
                            "host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    return attempt


def latest_records(rows: list[dict]) -> list[dict]:
    """The records of ``rows`` (one ``metrics.jsonl`` in file order) that no later attempt replaced, in file order.

    An attempt replaces every record of the attempts before it from its own first logged step on (those steps it ran
    again from its checkpoint, or from scratch). Records without ``attempt`` were written before attempts were
    recorded: they count as attempt 0, and among them a later record of a step replaces an earlier one (the
    restarted run appended its replay after them).
    """
    first: dict[int, int] = {}
    for row in rows:
        attempt = row.get("attempt", 0)
        first[attempt] = min(first.get(attempt, row["step"]), row["step"])
    cutoff = {a: min((s for b, s in first.items() if b > a), default=math.inf) for a in first}
    kept = [row for row in rows if row["step"] < cutoff[row.get("attempt", 0)]]
    # A step has a training record and may have a validation record: each is replaced by its own kind only.
    last = {(row.get("attempt", 0), row["step"], "val_loss" in row): i for i, row in enumerate(kept)}
    return [kept[i] for i in sorted(last.values())]


def read_metrics(path: str | os.PathLike[str], *, all_attempts: bool = False) -> list[dict]:
    """The records of a ``metrics.jsonl``: with ``all_attempts`` every record in file order, else the run's history
    (:func:`latest_records`). A line that does not parse is one a kill cut short; it is left out."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows if all_attempts else latest_records(rows)
