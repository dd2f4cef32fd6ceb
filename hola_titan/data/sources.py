"""Where documents come from: the bundled corpus, local files, or a Hugging Face hub dataset.

A ``dataset`` string is resolved by :func:`resolve_source`:

* ``"bundled"``: ``hola_titan/assets/corpus/{split}.jsonl.gz``, splits ``train`` and ``validation`` (see the
  README there); the text field is always ``text``.
* A local path: a file, a folder (searched recursively) or a glob (``data/*.jsonl``) of files ending in
  ``.jsonl``, ``.json`` (a JSON list of objects, or JSON Lines), ``.parquet`` (read with ``pyarrow``), ``.txt``
  (``txt_documents="paragraph"``: one document per block of lines separated by blank lines; ``"file"``: one
  document per file), each optionally ``.gz``-compressed (not parquet). Files are read in sorted path order. A folder
  that has a sub-folder named like the split (``data/train``, ``data/validation``) reads that sub-folder;
  otherwise the split is not used for local data.
  A string is taken as local when it exists, contains a glob character, starts with ``/``, ``.`` or ``~``, ends
  with one of the suffixes above, or has more than one ``/``; a local path that does not exist raises
  ``FileNotFoundError``.
* Anything else is a hub name (``owner/name``), read with ``datasets.load_dataset(name, dataset_config,
  split=split, streaming=...)``. ``datasets`` is imported only here, so bundled and local data work without it.

A record whose text field is missing or not a string raises ``ValueError`` naming the file, the record and the
field.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hola_titan.data.tokenizer import ASSETS_DIR, BUNDLED

BUNDLED_CORPUS_DIR = ASSETS_DIR / "corpus"
BUNDLED_SPLITS = ("train", "validation")
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".jsonl.gz", ".json.gz", ".txt.gz")
TxtDocuments = Literal["paragraph", "file"]


@dataclass(frozen=True)
class Source:
    """A resolved ``dataset`` argument."""

    kind: Literal["bundled", "local", "hub"]
    dataset: str
    """The string it was resolved from."""
    split: str
    text_field: str
    files: tuple[Path, ...] = ()
    """Bundled and local: the files, in reading order."""
    dataset_config: str | None = None
    """Hub only: the configuration (subset) name."""
    txt_documents: TxtDocuments = "paragraph"

    def cache_key(self) -> tuple[Any, ...]:
        """Identifies the documents this source yields (file sizes and modification times included)."""
        stats = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files)
        return (self.kind, self.dataset, self.split, self.text_field, self.dataset_config, self.txt_documents, stats)


def _looks_local(dataset: str) -> bool:
    return (os.path.exists(dataset) or any(c in dataset for c in "*?[") or dataset.startswith(("/", ".", "~"))
            or dataset.endswith(TEXT_SUFFIXES) or dataset.count("/") > 1)


def _has_text_suffix(path: Path) -> bool:
    return path.name.endswith(TEXT_SUFFIXES)


def resolve_source(dataset: str, *, split: str, text_field: str = "text", dataset_config: str | None = None,
                   txt_documents: TxtDocuments = "paragraph") -> Source:
    """Resolve ``dataset`` (module docstring) without reading any document.

    Raises:
        FileNotFoundError: a local path that does not exist or holds no readable file.
        ValueError: an unknown bundled split, an empty ``text_field``, or an unknown ``txt_documents``.
    """
    if not text_field:
        raise ValueError("text_field must be a non-empty column name")
    if txt_documents not in ("paragraph", "file"):
        raise ValueError(f"txt_documents must be 'paragraph' or 'file', got {txt_documents!r}")
    if dataset == BUNDLED:
        if split not in BUNDLED_SPLITS:
            raise ValueError(f"dataset 'bundled' has splits {BUNDLED_SPLITS}, got split {split!r}")
        file = BUNDLED_CORPUS_DIR / f"{split}.jsonl.gz"
        if not file.is_file():
            raise FileNotFoundError(f"bundled corpus file {file} is missing; rebuild it with "
                                    "scripts/build_bundled_data.py")
        return Source(kind="bundled", dataset=dataset, split=split, text_field="text", files=(file,))
    if not _looks_local(dataset):
        return Source(kind="hub", dataset=dataset, split=split, text_field=text_field,
                      dataset_config=dataset_config)

    path = Path(dataset).expanduser()
    if path.is_file():
        if not _has_text_suffix(path):
            raise ValueError(f"dataset {dataset!r}: unsupported file type (expected one of {TEXT_SUFFIXES})")
        files = [path]
    elif path.is_dir():
        folder = path / split if (path / split).is_dir() else path
        files = sorted(p for p in folder.rglob("*") if p.is_file() and _has_text_suffix(p))
    elif any(c in dataset for c in "*?["):
        files = sorted(p for p in map(Path, glob.glob(os.path.expanduser(dataset), recursive=True))
                       if p.is_file() and _has_text_suffix(p))
    else:
        raise FileNotFoundError(f"dataset path {dataset!r} does not exist")
    if not files:
        raise FileNotFoundError(f"dataset path {dataset!r} matches no {'/'.join(TEXT_SUFFIXES)} file")
    return Source(kind="local", dataset=dataset, split=split, text_field=text_field, files=tuple(files),
                  txt_documents=txt_documents)


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _field(record: Any, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with a {field!r} field, got {type(record).__name__}")
    if field not in record:
        raise ValueError(f"{where}: no text field {field!r} (fields: {', '.join(map(str, record)) or 'none'})")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: text field {field!r} holds {type(value).__name__}, not a string")
    return value


def _json_documents(path: Path, field: str) -> Iterator[str]:
    with _open_text(path) as handle:
        content = handle.read()
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        try:
            records = json.loads(content)
        except json.JSONDecodeError:
            records = None  # several values: JSON Lines in a .json file
        if records is not None:
            if not isinstance(records, list):
                raise ValueError(f"{path}: expected a JSON list of objects or JSON Lines")
            for index, record in enumerate(records):
                yield _field(record, field, f"{path} item {index}")
            return
    for number, line in enumerate(content.splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number}: not valid JSON ({error})") from error
            yield _field(record, field, f"{path} line {number}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"{path}: reading parquet files needs the pyarrow package") from error
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: no text field {field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in parquet.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, str):
                raise ValueError(f"{path} row {row}: text field {field!r} holds {type(value).__name__}, not a string")
            row += 1
            yield value


def _txt_documents(path: Path, mode: TxtDocuments) -> Iterator[str]:
    with _open_text(path) as handle:
        content = handle.read()
    if mode == "file":
        if content.strip():
            yield content
        return
    for block in re.split(r"\n[ \t]*\n", content.replace("\r\n", "\n")):
        block = block.strip("\n")
        if block.strip():
            yield block


def read_documents(source: Source) -> Iterator[str]:
    """Documents of a bundled or local source, in order (a finite iterator)."""
    if source.kind == "hub":
        raise ValueError(f"dataset {source.dataset!r} is a hub dataset; use hub_documents")
    for path in source.files:
        name = path.name
        if name.endswith(".parquet"):
            yield from _parquet_documents(path, source.text_field)
        elif name.endswith((".txt", ".txt.gz")):
            yield from _txt_documents(path, source.txt_documents)
        else:
            yield from _json_documents(path, source.text_field)


def hub_documents(source: Source, *, streaming: bool, skip: int = 0) -> Iterator[str]:
    """Documents of a hub dataset in its stored order, starting after the first ``skip`` documents."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"dataset {source.dataset!r} is read as a Hugging Face hub name, which needs the "
                          "datasets package (a local path must exist, or start with / or ./)") from error
    data = datasets.load_dataset(source.dataset, source.dataset_config, split=source.split, streaming=streaming)
    columns = getattr(data, "column_names", None)
    if columns is not None and source.text_field not in columns:
        raise ValueError(f"dataset {source.dataset!r}: no text field {source.text_field!r} "
                         f"(columns: {', '.join(columns)})")
    if skip:
        data = data.skip(skip) if hasattr(data, "skip") else data.select(range(skip, len(data)))
    records: Iterable[Any] = data
    for index, record in enumerate(records, start=skip):
        yield _field(record, source.text_field, f"dataset {source.dataset!r} record {index}")
