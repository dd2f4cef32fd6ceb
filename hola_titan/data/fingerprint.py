"""What identifies the documents of a source, for a resume to compare and for the token cache's key.

Bundled and local data: per file its path, size, modification time and the sha256 of its whole content (and of its
first and last MiB, what checkpoints from before content hashes recorded, so that those can still be compared
that far). Hub data: its name, configuration and split.

Hashing a file reads all of it (about 1 s per GB on one core), so the hash is computed once per node and kept in
``hash_cache`` (``job.cache_folder``/``data_hashes``), one small JSON file per file version, keyed by the file's
path, size, modification time, inode and status-change time. The status-change time (``st_ctime``) is what makes
the key safe: any write to the file, and any ``os.utime`` that puts an old modification time back, sets it to the
current time, and no user call can set it back. A file whose key is not in the cache is hashed again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hola_titan.staging import write_text_atomic

logger = logging.getLogger(__name__)

_ENDS_BYTES = 1 << 20
_READ_BYTES = 1 << 24
_FORMAT = "hola_titan.data_hash/1"
# Hashes of file versions seen by this process: the training and validation loaders of one run read the same files.
_HASHED: dict[tuple[Any, ...], dict[str, str]] = {}


def _stat_key(path: Path) -> tuple[Any, ...]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)


def _hash_file(path: Path, size: int) -> dict[str, str]:
    """sha256 of the whole file and of its first and last MiB, in one pass."""
    whole, head, tail = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as handle:
        first = handle.read(_ENDS_BYTES)
        head.update(first)
        whole.update(first)
        while chunk := handle.read(_READ_BYTES):
            whole.update(chunk)
        handle.seek(max(0, size - _ENDS_BYTES))
        tail.update(handle.read(_ENDS_BYTES))
    return {"sha256": whole.hexdigest(), "head": head.hexdigest()[:16], "tail": tail.hexdigest()[:16]}


def _cache_file(hash_cache: Path, key: tuple[Any, ...]) -> Path:
    return hash_cache / f"{hashlib.sha256(repr((_FORMAT, key)).encode()).hexdigest()[:32]}.json"


def _read_cached(path: Path, key: tuple[Any, ...]) -> dict[str, str] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or unreadable: hashed again and rewritten
    # The stored key guards against a name collision and against a file written by another format.
    if not isinstance(entry, dict) or entry.get("format") != _FORMAT or entry.get("key") != list(key):
        return None
    hashes = {name: entry.get(name) for name in ("sha256", "head", "tail")}
    return hashes if all(isinstance(value, str) for value in hashes.values()) else None


def _write_cached(path: Path, key: tuple[Any, ...], hashes: dict[str, str]) -> None:
    """Atomically (renamed into place); a cache that cannot be written costs the next process a hash, not this run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"format": _FORMAT, "key": list(key), **hashes}))
    except OSError as err:
        logger.warning("data hash cache %s not written (%s): the next process hashes %s again", path, err, key[0])


def file_hashes(path: Path, *, hash_cache: Path | None = None) -> dict[str, str]:
    """``{"sha256", "head", "tail"}`` of ``path`` (module docstring), from this process's memory, from
    ``hash_cache``, or computed (and then kept in both)."""
    key = _stat_key(path)
    hashes = _HASHED.get(key)
    if hashes is None and hash_cache is not None:
        with _node_lock(_cache_file(hash_cache, key)):
            # The ranks of a node start together: the first to take the lock hashes the file and keeps the result,
            # the others wait for it and read it, instead of each reading the whole corpus.
            hashes = _computed(path, key, hash_cache)
    elif hashes is None:
        hashes = _computed(path, key, None)
    _HASHED[key] = hashes
    return hashes


@contextmanager
def _node_lock(cache_file: Path):
    """An exclusive lock beside ``cache_file`` (``flock``: released when the process ends, however it ends); none
    where the cache folder cannot be made or locked (then every rank hashes for itself, as without a cache)."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache_file.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        handle.close()


def _computed(path: Path, key: tuple[Any, ...], hash_cache: Path | None) -> dict[str, str]:
    """The cached hashes of ``path``, or its hashes computed now and kept in ``hash_cache``."""
    hashes = _read_cached(_cache_file(hash_cache, key), key) if hash_cache is not None else None
    if hashes is None:
        begin = time.perf_counter()
        hashes = _hash_file(path, key[1])
        seconds = time.perf_counter() - begin
        if seconds > 1:
            logger.info("data: hashed %s (%.1f GB) in %.1f s%s", path, key[1] / 1e9, seconds,
                        "; kept for the node's next process" if hash_cache is not None else "")
        if hash_cache is not None:
            _write_cached(_cache_file(hash_cache, key), key, hashes)
    return hashes


def source_fingerprint(source, *, hash_cache: Path | None = None) -> dict[str, Any]:
    """What identifies the documents of ``source`` (a :class:`hola_titan.data.sources.Source`; module docstring)."""
    if source.kind == "hub":
        return {"kind": "hub", "dataset": source.dataset, "config": source.dataset_config, "split": source.split}
    files = []
    for path in source.files:
        stat = path.stat()
        files.append({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      **file_hashes(path, hash_cache=hash_cache)})
    return {"kind": source.kind, "dataset": source.dataset, "split": source.split, "files": files}


def fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """``(changes, touched, by_ends)`` between two fingerprints: what differs in the documents (files added,
    removed, resized or with other content), files whose modification time alone changed (a copy or a ``touch``),
    and files that ``saved`` (written before content hashes) lets compare only by size and both ends."""
    if saved.get("kind") != now.get("kind") or saved.get("kind") == "hub":
        def name(fp):
            return f"{fp.get('dataset')} ({fp.get('kind')}, config {fp.get('config')}, split {fp.get('split')})"
        return [f"{name(saved)} -> {name(now)}"] if saved != now else [], [], []
    before = {f["path"]: f for f in saved.get("files", [])}
    after = {f["path"]: f for f in now.get("files", [])}
    changes = [f"{p} is new" for p in after if p not in before]
    changes += [f"{p} is gone" for p in before if p not in after]
    touched, by_ends = [], []
    for path in before.keys() & after.keys():
        a, b = before[path], after[path]
        if a["size"] != b["size"]:
            changes.append(f"{path}: {a['size']:,} -> {b['size']:,} bytes")
        elif "sha256" in a and a["sha256"] != b["sha256"]:
            changes.append(f"{path}: other content at the same size (sha256 {a['sha256'][:12]}... -> "
                           f"{b['sha256'][:12]}...)")
        elif (a["head"], a["tail"]) != (b["head"], b["tail"]):
            changes.append(f"{path}: other content at the same size")
        elif a["mtime_ns"] != b["mtime_ns"]:
            touched.append(path)
        if "sha256" not in a:
            by_ends.append(path)
    return sorted(changes), sorted(touched), sorted(by_ends)
