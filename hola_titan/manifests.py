"""The size and digest of every file in a folder, and the check of a folder against them: one implementation for
the two manifests that record them.

A checkpoint's ``manifest.json`` uses xxh3 (fast enough to hash every save on the training path); an export's uses
sha256 (what a user who downloads it compares with ``sha256sum``). Each caller keeps its own record format and
error wording; what they share is how files are listed, hashed and compared, so that a truncated, changed or
missing file is found the same way in both.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HASH_CHUNK = 8 << 20
HASHES = ("sha256", "xxh3_64")


def digest_file(path: str | os.PathLike[str], hash_name: str) -> str:
    """The hex digest of the file at ``path`` (``hash_name`` one of :data:`HASHES`), read in chunks."""
    if hash_name == "sha256":
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    if hash_name == "xxh3_64":
        import xxhash

        h = xxhash.xxh3_64()
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    raise ValueError(f"hash: expected one of {', '.join(HASHES)}, got {hash_name!r}")


def file_records(folder: str | os.PathLike[str], *, hash_name: str, key: str,
                 skip: Callable[[str], bool]) -> dict[str, dict]:
    """``{name: {"size": bytes, key: digest}}`` for every file directly in ``folder`` whose name ``skip`` does not
    exclude (the manifest itself, which a record cannot list), in name order."""
    return {f.name: {"size": f.stat().st_size, key: digest_file(f, hash_name)}
            for f in sorted(Path(folder).iterdir()) if f.is_file() and not skip(f.name)}


@dataclass(frozen=True)
class Mismatch:
    """The first listed file that does not match: ``kind`` is "missing", "size" (``found`` bytes, ``expected``
    listed), "digest" or "unreadable" (``detail``: the system's reason)."""
    name: str
    kind: str
    found: int | None = None
    expected: int | None = None
    detail: str = ""

    def describe(self, manifest: str, since: str, digest: str = "checksum") -> str:
        """What is wrong with the file, as the end of a sentence that names it: ``manifest`` is the record's file
        name, ``since`` what wrote the record ("the export", "the save"), ``digest`` what users call its digest."""
        return {"missing": f"missing (listed in {manifest})",
                "size": f"{self.found} bytes, {manifest} says {self.expected} (truncated or overwritten since "
                        f"{since})",
                "digest": f"does not match its {digest} in {manifest} (its bytes changed since {since})",
                "unreadable": f"cannot be read ({self.detail})"}[self.kind]


def first_mismatch(folder: str | os.PathLike[str], files: dict[str, tuple[int, str]], *, hash_name: str,
                   checksums: bool = True) -> Mismatch | None:
    """Check each listed ``name: (size, digest)`` in ``folder``: present, its size, and (``checksums``) its digest.
    Sizes of every file are checked before any digest, so a truncated file is named without reading gigabytes of
    the others. None when all match."""
    folder = Path(folder)
    for name, (size, _) in files.items():
        try:
            found = (folder / name).stat().st_size
        except FileNotFoundError:
            return Mismatch(name, "missing")
        except OSError as error:
            return Mismatch(name, "unreadable", detail=error.strerror or str(error))
        if found != size:
            return Mismatch(name, "size", found=found, expected=size)
    if checksums:
        for name, (_, digest) in files.items():
            try:
                if digest_file(folder / name, hash_name) != digest:
                    return Mismatch(name, "digest")
            except OSError as error:
                return Mismatch(name, "unreadable", detail=error.strerror or str(error))
    return None
