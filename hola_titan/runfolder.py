"""One writer per run folder: an exclusive lock on ``<job.dump_folder>/.lock``, and workers that stop when their
launcher is gone.

Two trainers writing one dump folder interleave ``metrics.jsonl`` and race each other's checkpoint saves. The
process that writes the folder (rank 0) holds an exclusive ``flock`` on ``<dump_folder>/.lock`` for as long as its
trainer lives; the file names the holder (pid, host, start time, command). A second run on the folder fails at
start with an error naming the holder. The kernel releases the lock when the holding process ends in any way
(``kill -9`` included), so a lock left by a dead run never blocks: the next run takes it and says whose it was.
Inside one process the lock is shared (a notebook or a test that builds a second trainer on the same folder).
``flock`` holds on local file systems and on NFS v4; on file systems without it the lock may not be exclusive.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("hola_titan")

LOCK_NAME = ".lock"


class RunFolderError(RuntimeError):
    """The run folder cannot serve this run (the one-line error names why)."""


class FolderInUseError(RunFolderError):
    """Another live process holds the run folder's lock; the message names it."""


class FolderUnusableError(RunFolderError):
    """The run folder cannot be made or written: a file is in its place, or the file system refuses."""


def _check_is_folder(folder: Path, key: str) -> None:
    """Raise :class:`FolderUnusableError` naming the path and the cause when ``folder`` (config key ``key``) cannot
    be a folder: a file in its place or in its parents' place, a symbolic link loop or a dangling link on its way,
    a name longer than the file system takes. Reads only: called before anything is made."""
    for path in (folder, *folder.parents):
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(path):
                raise FolderUnusableError(f"{folder}: {path} is a symbolic link to {os.readlink(path)}, which does "
                                          f"not exist; create its target or choose another {key}") from None
            continue  # made by the run, unless a parent is a file (found further up)
        except OSError as error:
            raise FolderUnusableError(_path_problem(folder, error, key)) from None
        if not stat.S_ISDIR(mode):
            raise FolderUnusableError(f"{folder}: {path} is a file, not a folder; choose another {key}")
        return


def _path_problem(folder: Path, error: OSError, key: str) -> str:
    """The one line for a path that the file system refuses to look up (``os.stat`` of it failed with ``error``)."""
    if error.errno == errno.ELOOP:
        # The first prefix that cannot be looked up is the link that loops (or leads into a loop).
        looping = next((path for path in (*reversed(folder.parents), folder) if _loops(path)), folder)
        return f"{folder}: {looping} is a symbolic link loop ({error.strerror}); choose another {key}"
    if error.errno == errno.ENAMETOOLONG:
        existing = next((path for path in folder.parents if os.path.isdir(path)), Path("/"))
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        long = [part for part in folder.parts if len(os.fsencode(part)) > name_max]
        what = (f"the name {long[0][:40]}... is {len(os.fsencode(long[0]))} bytes, more than the {name_max} the file "
                f"system at {existing} takes" if long else
                f"the path is {len(os.fsencode(str(folder)))} bytes, longer than the system takes")
        return f"{folder}: {what} ({error.strerror}); choose a shorter {key}"
    return f"{folder}: {error.filename or folder} cannot be looked up ({error.strerror}); choose another {key}"


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def check_folder_path(folder: str | os.PathLike[str], *, key: str) -> None:
    """Raise :class:`FolderUnusableError` naming the path and the cause when ``folder`` (config key ``key``) cannot
    be a folder (a file in the way, a symbolic link loop, a dangling link, a name too long); makes nothing."""
    _check_is_folder(Path(folder), key)


def check_writable_folder(folder: str | os.PathLike[str], *, key: str) -> None:
    """Raise :class:`FolderUnusableError` naming ``folder`` (config key ``key``) and the cause when files cannot be
    made in it (read-only file system, permissions), or, where it does not exist yet, in the nearest folder above
    it that does (where it will be made). Checked by making and removing one empty file, which also catches what
    permission bits do not say (a read-only mount, an ACL); the run's first save would otherwise find it."""
    folder = Path(folder)
    _check_is_folder(folder, key)
    existing = next(path for path in (folder, *folder.parents) if os.path.isdir(path))
    try:
        handle, probe = tempfile.mkstemp(prefix=".write_check.", dir=existing)
    except OSError as error:
        where = "" if existing == folder else f" (it would be made in {existing}, which cannot be written)"
        raise FolderUnusableError(f"{folder}: cannot write files there{where} ({error.strerror}); fix its "
                                  f"permissions or choose another {key}") from None
    os.close(handle)
    os.unlink(probe)


class _Held:
    def __init__(self, handle, path: Path):
        self.handle, self.path, self.users = handle, path, 0


_HELD: dict[str, _Held] = {}


def _holder_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)[:300]}


def _describe(info: dict) -> str:
    return (f"process {info.get('pid', '?')} on {info.get('host', '?')} (started {info.get('started', '?')}: "
            f"{info.get('command', '?')})")


class RunFolderLock:
    """The exclusive lock of one run folder, held until :meth:`release` (or the process ends)."""

    def __init__(self, folder: str | os.PathLike[str], *, key: str = "job.dump_folder"):
        self.folder = Path(folder)
        self.key = key  # the config key that names the folder, for the messages
        self._key: str | None = None

    def acquire(self) -> RunFolderLock:
        """Take the lock; raises :class:`FolderInUseError` naming the holder when another process has it, and
        :class:`FolderUnusableError` when the folder cannot be made or written."""
        _check_is_folder(self.folder, self.key)
        path = self.folder / LOCK_NAME
        key = str(path.resolve())
        held = _HELD.get(key)
        if held is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                handle = open(path, "a+")
            except OSError as error:
                raise FolderUnusableError(f"{self.folder}: the run folder cannot be written ({error.strerror}); "
                                          f"choose another {self.key} or fix its permissions") from None
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    handle.close()
                    raise
                handle.seek(0)
                info = _read(handle.read())
                handle.close()
                raise FolderInUseError(f"{self.folder} is in use by {_describe(info)}; stop that run or choose "
                                       f"another {self.key}") from None
            handle.seek(0)
            previous = _read(handle.read())
            if previous.get("pid") is not None and previous.get("pid") != os.getpid():
                logger.info("run folder: taking over %s, last held by %s, which has ended", path,
                            _describe(previous))
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(_holder_info()) + "\n")
            handle.flush()
            held = _HELD[key] = _Held(handle, path)
        held.users += 1
        self._key = key
        return self

    def probe(self) -> None:
        """Raise :class:`FolderInUseError` when another process holds the lock (and :class:`FolderUnusableError` when
        a file stands where the folder would be); take nothing and write nothing."""
        _check_is_folder(self.folder, self.key)
        path = self.folder / LOCK_NAME
        if not path.is_file() or str(path.resolve()) in _HELD:
            return
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise FolderInUseError(f"{self.folder} is in use by {_describe(_read(handle.read()))}; stop that run "
                                       f"or choose another {self.key}") from None
            fcntl.flock(handle, fcntl.LOCK_UN)

    def release(self) -> None:
        """Give the lock back (the last user in this process closes it). Idempotent."""
        key, self._key = self._key, None
        held = _HELD.get(key) if key else None
        if held is None:
            return
        held.users -= 1
        if held.users == 0:
            del _HELD[key]
            # A clean release empties the file: what is left in it names a holder that ended without releasing.
            held.handle.seek(0)
            held.handle.truncate()
            held.handle.flush()
            fcntl.flock(held.handle, fcntl.LOCK_UN)
            held.handle.close()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _read(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}


def watch_parent(on_orphaned: Callable[[int], None], *, interval: float = 0.5) -> threading.Thread:
    """Call ``on_orphaned(parent)`` from a daemon thread once this process's parent (as at this call) has ended.

    torchrun starts its workers in their own sessions, so a worker whose torchrun is gone (killed with
    ``run_train.sh``, or on its own) would train on, holding the run folder. Polling ``os.getppid()`` rather than
    ``PR_SET_PDEATHSIG``: the kernel sends that signal when the *thread* that started the child ends, which need not
    be torchrun's end, and a thread here can also bound how long the orphan lives (the trainer's handler)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        on_orphaned(parent)

    thread = threading.Thread(target=watch, name="watch_parent", daemon=True)
    thread.start()
    return thread
