"""Folders written whole or not at all: a writer fills a hidden sibling and renames it into place when complete.

Used by the export (:func:`hola_titan.export.save_pretrained`) and by ``scripts/import_safetensors.py``::

    with staged_folder(out, replaceable=is_export) as tmp:
        ...write every file into tmp...
    # here out holds the new folder; an earlier one was removed only after the new one was in place

The sibling (``.<name>.partial-XXXXXX``) is in the destination's parent, so the final rename never crosses a file
system. An error in the body (a full disk, a file-size limit, a read-only parent) removes it, leaves the destination
as it was, and becomes one :class:`FolderWriteError` naming the destination and the cause. A destination that exists
and is neither empty nor ``replaceable`` is refused before anything is written: no tool removes a folder it did
not make. Replacing takes two renames (the old folder aside as ``.<name>.old-XXXXXX``, the new one into place) and
then removes the old one; a process killed between the two leaves both on disk, the old one under that name.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_TAG = ".partial-"
OLD_TAG = ".old-"


class FolderWriteError(ValueError):
    """A folder cannot be written; one line naming the path and the cause. (A ``ValueError``, so the callers'
    existing handlers of bad input report it as one.)"""


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and every error behind it: its cause chain (``__cause__`` and ``__context__``) and the failures DCP
    collects per rank, each once, ``error`` first. One walk for every reader of a failed write's cause."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "_failures", None) or {}).values():  # DCP's CheckpointException
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return seen


def _errno_of(error: BaseException) -> tuple[int | None, str | None]:
    """The errno behind ``error`` and the file it names: an ``OSError`` anywhere in :func:`error_chain`, else an
    ``(os error N)`` in the text (what safetensors' Rust writer raises)."""
    seen = error_chain(error)
    for e in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno, e.filename
    for e in seen:
        match = re.search(r"os error (\d+)", str(e))
        if match:
            return int(match.group(1)), None
    return None, None


def describe_write_error(error: BaseException, where: Path) -> str:
    """What went wrong writing under ``where``, in words a user acts on: a full disk with the space left, the
    file-size limit with its value (not "no space left": the disk may be empty), or the system's own words."""
    code, filename = _errno_of(error)
    if code == errno.ENOSPC or code == errno.EDQUOT:
        probe = where if where.exists() else where.parent
        try:
            free = f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free in {probe}"
        except OSError:
            free = f"free space in {probe} unknown"
        return f"no space left on the device ({free})" if code == errno.ENOSPC else f"disk quota exceeded ({free})"
    if code == errno.EFBIG:
        return f"a file reached {file_size_limit()}, not a full disk; raise the limit"
    if code is not None:
        return f"{os.strerror(code)}{f' ({filename})' if filename else ''}"
    return f"{type(error).__name__}: {str(error)[:200]}"


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a hidden sibling renamed into place: a reader, or a crash, sees the old
    file or the new one, never a torn one. The sibling's name carries the process and thread, so concurrent writers
    of one path never share it; a failed write removes it and raises the ``OSError``."""
    import threading

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def file_size_limit() -> str:
    """The limit a write failing with ``EFBIG`` ran into, in words: the process's ``RLIMIT_FSIZE`` (``ulimit -f``)
    when one is set, else the largest file the file system takes."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return "the largest file size the file system takes"
    return f"the file size limit of {limit / 2**20:,.1f} MiB ({limit:,} bytes; RLIMIT_FSIZE, ulimit -f)"


def check_destination(dest: Path, *, replaceable: Callable[[Path], bool], what: str,
                      hint: str = "choose another output folder") -> None:
    """Refuse ``dest`` when it exists and is not an empty folder or one ``replaceable`` accepts; ``hint`` ends the
    message (what the user can do)."""
    if not dest.exists() and not dest.is_symlink():
        return
    if not dest.is_dir():
        raise FolderWriteError(f"{dest}: exists and is not a folder; {hint}")
    try:
        entries = sorted(p.name for p in dest.iterdir())
    except OSError as error:
        raise FolderWriteError(f"{dest}: cannot be read ({error.strerror}); {hint}") from None
    if entries and not replaceable(dest):
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise FolderWriteError(f"{dest}: exists and holds what is not a {what} ({shown}); it is left as it is; "
                               f"{hint}")


@contextmanager
def staged_folder(dest: str | os.PathLike[str], *, replaceable: Callable[[Path], bool], what: str,
                  carry: Callable[[str], bool] = lambda name: False,
                  hint: str = "choose another output folder") -> Iterator[Path]:
    """Yield an empty hidden sibling of ``dest``; when the body returns, it becomes ``dest`` (module docstring).

    Args:
        dest: the folder to write.
        replaceable: whether an existing non-empty ``dest`` may be replaced (it was written by this tool).
        what: what the folder holds, for messages ("safetensors export").
        carry: names of entries of a replaced ``dest`` that are copied into the new folder before the swap (files
            a user added, which the writer does not write).
        hint: what the user can do about a refused ``dest`` (the end of the message).

    Raises:
        FolderWriteError: ``dest`` is refused, or writing failed (the cause named; ``dest`` unchanged).
    """
    dest = Path(dest)
    if dest.is_symlink() and dest.is_dir():
        # A link to a folder (say exports/latest -> run-5): the folder it names is replaced, the link stays.
        dest = dest.resolve()
    check_destination(dest, replaceable=replaceable, what=what, hint=hint)
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{PARTIAL_TAG}", dir=parent))
    except OSError as error:
        raise FolderWriteError(f"{dest}: cannot create a folder in {parent} ({describe_write_error(error, parent)})"
                               ) from None
    # mkdtemp makes 0700; the folder gets the mode mkdir would give it, so whoever may read the parent may read it.
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        old = None
        if dest.is_dir() and any(dest.iterdir()):
            for entry in dest.iterdir():
                if carry(entry.name) and not (tmp / entry.name).exists():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.copytree(entry, tmp / entry.name, symlinks=True)
                    else:
                        shutil.copy2(entry, tmp / entry.name, follow_symlinks=False)
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}{OLD_TAG}", dir=parent))
            try:
                os.replace(dest, old)  # onto the empty folder mkdtemp made: rename(2) replaces an empty directory
            except OSError:
                old.rmdir()  # the empty folder made for it, not left behind
                raise
        elif dest.is_dir():
            dest.rmdir()
        try:
            os.replace(tmp, dest)
        except OSError:
            if old is not None:
                os.replace(old, dest)  # the new one did not go in: the old one goes back
            raise
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, (FolderWriteError, KeyboardInterrupt, SystemExit)):
            raise
        if not isinstance(error, OSError) and _errno_of(error)[0] is None:
            raise  # a mistake in what was written (a wrong key, a bad argument), not a failure of the file system
        kept = (f"the {what} already in {dest} is unchanged" if dest.exists() and any(dest.iterdir())
                else "nothing was left behind")
        raise FolderWriteError(f"{dest}: writing the {what} failed: {describe_write_error(error, dest)}; {kept}"
                               ) from error
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only set it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
