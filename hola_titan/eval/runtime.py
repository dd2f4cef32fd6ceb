"""What every evaluation shares: the error type, lengths like ``4k``, device and dtype choice, peak memory.

Peak memory of the process: on CUDA, ``torch.cuda.max_memory_allocated`` after a reset; on CPU (Linux), the
resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, reset by writing ``5`` to ``/proc/self/clear_refs``
so that each measurement starts from the current resident size. Where that reset is not allowed, the lifetime
maximum ``ru_maxrss`` is reported and ``resettable`` is False (then only increases are meaningful).
"""

from __future__ import annotations

import gc
import resource
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EvalError(Exception):
    """A user mistake or an unusable input; the command line prints ``error: <message>`` on one line and exits 2."""


def parse_length(text: str) -> int:
    """``"4k"`` -> 4096, ``"1m"`` -> 1048576, ``"300"`` -> 300 (k = 1024 as in RULER's length names)."""
    raw = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(raw[-1:], 1)
    digits = raw[:-1] if scale != 1 else raw
    try:
        value = int(digits) * scale
    except ValueError:
        raise EvalError(f"length {text!r}: expected an integer, optionally with k or m (4k = 4096)") from None
    if value < 1:
        raise EvalError(f"length {text!r}: must be >= 1")
    return value


def format_length(tokens: int) -> str:
    """4096 -> ``"4k"``; lengths that are not a multiple of 1024 stay plain."""
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def parse_list(text: str, parse: Callable[[str], T], *, what: str) -> list[T]:
    """Comma-separated values; raises :class:`EvalError` naming ``what`` on an empty list."""
    items = [parse(part) for part in text.split(",") if part.strip()]
    if not items:
        raise EvalError(f"{what}: expected a comma-separated list, got {text!r}")
    return items


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise EvalError(f"expected an integer, got {text!r}") from None


def parse_percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EvalError(f"depth {text!r}: expected a percentage 0-100") from None
    if not 0 <= value <= 100:
        raise EvalError(f"depth {text!r}: expected a percentage 0-100")
    return value


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: no CUDA device is available")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise EvalError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Peak memory over a stretch of work (module docstring); ``reset`` starts a stretch, ``peak_bytes`` ends it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = True

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")
        except OSError:
            self.resettable = False

    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _status_kib("VmRSS")
        return 0 if rss is None else rss * 1024

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _status_kib("VmHWM") if self.resettable else None
        if hwm is None:
            self.resettable = False
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return hwm * 1024

    @property
    def kind(self) -> str:
        """What ``peak_bytes`` measures, for reports."""
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated"
        return "process VmHWM (reset per measurement)" if self.resettable else "process ru_maxrss (lifetime peak)"


def progress(iterable: Iterable[T], *, enabled: bool, total: int | None = None, desc: str = "") -> Iterable[T]:
    """``tqdm`` over ``iterable`` on stderr, or the iterable itself when progress bars are off."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
