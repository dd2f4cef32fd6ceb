"""Run Python command lines one after another in one interpreter, so that their imports are paid once.

Usage::

    python scripts/run_in_one_process.py STAGES.json STATUS.jsonl

``STAGES.json`` is a list of ``{"name": ..., "argv": ["python", "-m", MODULE, ARG, ...]}`` or
``{"name": ..., "argv": ["python", SCRIPT, ARG, ...]}``; each runs as ``python`` would run it (``runpy``, as
``__main__``, with ``sys.argv`` set), from the current folder. After each, one line ``{"name", "rc", "seconds"}``
is appended to ``STATUS.jsonl`` (flushed, so a caller that kills this process still knows which stages ended);
the first stage that ends with a status other than 0 ends the list. A last line ``{"name": "environment", ...}``
records the Python, torch and CUDA versions and the device the stages saw.

``scripts/replicate_small.py`` starts one of these per run (train, export, evaluations): on a GPU shared by nine
runs, importing torch and the project again for each of four or five commands would cost about a minute per run.
"""

from __future__ import annotations

import gc
import json
import platform
import runpy
import sys
import time
import traceback
from pathlib import Path


def launch(argv: list[str]) -> None:
    """Run ``argv`` (``python -m MODULE ...`` or ``python SCRIPT ...``) as ``python`` would, in this interpreter."""
    if len(argv) >= 3 and argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    elif len(argv) >= 2:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")
    else:
        raise ValueError(f"expected python -m MODULE ... or python SCRIPT ..., got {argv!r}")


def run_stage(argv: list[str]) -> int:
    """:func:`launch` ``argv``; its exit status (1 for a traceback, as ``python`` gives)."""
    try:
        launch(argv)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)  # sys.exit("message") prints the message and means status 1
        return 1
    except Exception:  # noqa: BLE001  (a traceback is this stage's failure, reported like python would)
        traceback.print_exc()
        return 1
    return 0


def release_memory() -> None:
    """What one stage left allocated goes before the next starts (nine runs share one GPU)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def environment() -> dict:
    torch = sys.modules.get("torch")
    row = {"name": "environment", "python": platform.python_version(), "host": platform.node()}
    if torch is not None:
        row["torch"] = torch.__version__
        row["cuda"] = torch.version.cuda
        row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return row


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/run_in_one_process.py STAGES.json STATUS.jsonl", file=sys.stderr)
        return 2
    stages = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    rc = 0
    with open(argv[1], "a", encoding="utf-8", buffering=1) as status:
        for stage in stages:
            print(f"=== {stage['name']}: {' '.join(stage['argv'])}", flush=True)
            start = time.perf_counter()
            rc = run_stage(stage["argv"])
            sys.stdout.flush()
            sys.stderr.flush()
            status.write(json.dumps({"name": stage["name"], "rc": rc, "seconds": time.perf_counter() - start}) + "\n")
            if rc != 0:
                break
            release_memory()
        status.write(json.dumps(environment()) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
