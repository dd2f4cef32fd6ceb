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
* Anything else with one ``/`` is a hub name (``owner/name``), read with ``datasets.load_dataset(name,
  dataset_config, split=split, streaming=...)``. ``datasets`` is imported only here, so bundled and local data work
  without it. A name without ``/`` that is no local path is refused at once (a mistyped folder would otherwise
  spend half a minute retrying the hub); the hub's legacy short names have ``owner/name`` forms (``wikitext`` is
  ``Salesforce/wikitext``).

Hold-out: local data without a split sub-folder has no validation documents of its own. With ``holdout_every = N``
(``data.holdout_every``), every N-th document in reading order (index N-1, 2N-1, ...) belongs to the
``validation`` split and is never read for any other split; with 0 there is no hold-out and asking such data for
its ``validation`` split is an error (it would read the training documents).

Problems with the data raise :class:`DataError` (a ``ValueError``) with one line naming the file, the record and
the fix; a path that does not exist raises ``FileNotFoundError``.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hola_titan.data.tokenizer import ASSETS_DIR, BUNDLED

BUNDLED_CORPUS_DIR = ASSETS_DIR / "corpus"
BUNDLED_SPLITS = ("train", "validation")
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".jsonl.gz", ".json.gz", ".txt.gz")
TxtDocuments = Literal["paragraph", "file"]


class DataError(ValueError):
    """A problem with the documents or their location; one line naming the file (and the record) and the fix."""


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
    holdout: Literal["train", "validation"] | None = None
    """Local data without split folders: which side of the hold-out this source reads (module docstring)."""
    holdout_every: int = 0

    @property
    def holdout_tag(self) -> str:
        """``"none"`` or e.g. ``"train/100"``: what a resumed loader checks."""
        return "none" if self.holdout is None else f"{self.holdout}/{self.holdout_every}"


def _looks_local(dataset: str) -> bool:
    return (os.path.exists(dataset) or any(c in dataset for c in "*?[") or dataset.startswith(("/", ".", "~"))
            or dataset.endswith(TEXT_SUFFIXES) or dataset.count("/") > 1)


def _has_text_suffix(path: Path) -> bool:
    return path.name.endswith(TEXT_SUFFIXES)


def resolve_source(dataset: str, *, split: str, text_field: str = "text", dataset_config: str | None = None,
                   txt_documents: TxtDocuments = "paragraph", holdout_every: int | None = None) -> Source:
    """Resolve ``dataset`` (module docstring) without reading any document.

    ``holdout_every``: the hold-out of local data without split folders (module docstring); None reads such
    data whole (an evaluation file, a separate validation dataset).

    Raises:
        FileNotFoundError: a local path that does not exist or holds no readable file.
        DataError: a name that is neither a local path nor ``owner/name``; the ``validation`` split of local data
            without one when ``holdout_every`` is 0.
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
        if "/" not in dataset:
            raise DataError(f"data.dataset: {dataset!r} is no local file or folder, and hub datasets are named "
                            "owner/name (e.g. Salesforce/wikitext); for a local folder check the path")
        return Source(kind="hub", dataset=dataset, split=split, text_field=text_field,
                      dataset_config=dataset_config)

    path = Path(dataset).expanduser()
    split_folder = False
    if path.is_file():
        if not _has_text_suffix(path):
            raise DataError(f"data.dataset: {dataset!r} has an unsupported file type (expected one of "
                            f"{', '.join(TEXT_SUFFIXES)})")
        files = [path]
    elif path.is_dir():
        split_folder = (path / split).is_dir()
        folder = path / split if split_folder else path
        files = sorted(p for p in folder.rglob("*") if p.is_file() and _has_text_suffix(p))
    elif any(c in dataset for c in "*?["):
        files = sorted(p for p in map(Path, glob.glob(os.path.expanduser(dataset), recursive=True))
                       if p.is_file() and _has_text_suffix(p))
    else:
        raise FileNotFoundError(f"dataset path {dataset!r} does not exist")
    if not files:
        raise FileNotFoundError(f"dataset path {dataset!r} matches no {'/'.join(TEXT_SUFFIXES)} file")
    holdout = None
    if not split_folder and holdout_every is not None:
        if holdout_every > 0:
            holdout = "validation" if split == "validation" else "train"
        elif split == "validation":
            raise DataError(f"data: {dataset!r} has no validation folder, and without a hold-out its validation "
                            "rows would be training documents; set data.holdout_every (every N-th document held "
                            "out) or validation.dataset, or validation.enable = false")
    return Source(kind="local", dataset=dataset, split=split, text_field=text_field, files=tuple(files),
                  txt_documents=txt_documents, holdout=holdout, holdout_every=holdout_every if holdout else 0)


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    """A text file's content (gunzipped for ``.gz``); ``DataError`` naming the file, and the line for bytes that are
    not UTF-8, instead of a decoder's traceback."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a readable gzip file ({error})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path} line {line}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at offset "
                        f"{error.start}); re-encode the file as UTF-8 or remove the line") from None


def _field(record: Any, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a {field!r} field, got {type(record).__name__}")
    if field not in record:
        raise DataError(f"{where}: no text field {field!r} (fields: {', '.join(map(str, record)) or 'none'}); set "
                        "data.text_field to the field that holds the text")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: text field {field!r} holds {type(value).__name__}, not a string (data.text_field "
                        "names the text)")
    return value


def _json_documents(path: Path, field: str) -> Iterator[str]:
    content = _read_text(path)
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        try:
            records = json.loads(content)
        except json.JSONDecodeError:
            records = None  # several values: JSON Lines in a .json file
        if records is not None:
            if not isinstance(records, list):
                raise DataError(f"{path}: expected a JSON list of objects or JSON Lines")
            for index, record in enumerate(records):
                yield _field(record, field, f"{path} item {index}")
            return
    for number, line in enumerate(content.splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number}: not valid JSON ({error}); fix or remove the line") from error
            yield _field(record, field, f"{path} line {number}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"{path}: reading parquet files needs the pyarrow package") from error
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if field not in names:
        raise DataError(f"{path}: no text field {field!r} (columns: {', '.join(names)}); set data.text_field to the "
                        "column that holds the text")
    row = 0
    for batch in parquet.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, str):
                raise DataError(f"{path} row {row}: text field {field!r} holds {type(value).__name__}, not a string")
            row += 1
            yield value


def _txt_documents(path: Path, mode: TxtDocuments) -> Iterator[str]:
    content = _read_text(path)
    if mode == "file":
        if content.strip():
            yield content
        return
    for block in re.split(r"\n[ \t]*\n", content.replace("\r\n", "\n")):
        block = block.strip("\n")
        if block.strip():
            yield block


def read_documents(source: Source) -> Iterator[str]:
    """Documents of a bundled or local source, in order (a finite iterator), the hold-out applied."""
    if source.kind == "hub":
        raise ValueError(f"dataset {source.dataset!r} is a hub dataset; use hub_documents")
    documents = _all_documents(source)
    if source.holdout is None:
        yield from documents
        return
    held_out = source.holdout == "validation"
    for index, text in enumerate(documents):
        if (index % source.holdout_every == source.holdout_every - 1) == held_out:
            yield text


def _all_documents(source: Source) -> Iterator[str]:
    for path in source.files:
        name = path.name
        if name.endswith(".parquet"):
            yield from _parquet_documents(path, source.text_field)
        elif name.endswith((".txt", ".txt.gz")):
            yield from _txt_documents(path, source.txt_documents)
        else:
            yield from _json_documents(path, source.text_field)


# ---------------------------------------------------------------------------------------------------------------
# Hub datasets on a node without network
# ---------------------------------------------------------------------------------------------------------------


def _hub_fetch_hint(source: Source) -> str:
    """How to make a hub dataset readable on a node without network (the end of a one-line error)."""
    name = source.dataset
    call = f"datasets.load_dataset({name!r}" + (f", {source.dataset_config!r}" if source.dataset_config else "") + ")"
    return (f"on a machine with network either run `python -c \"import datasets; {call}\"` with HF_DATASETS_CACHE "
            "(or HF_HOME) on storage this node reads, then point it there here too and set HF_HUB_OFFLINE=1, or "
            f"`hf download --repo-type dataset {name} --local-dir DIR` (huggingface-cli download with an older "
            "huggingface_hub) and give DIR's .jsonl/.parquet files as a local dataset")


def hub_cache_folders(source: Source) -> list[Path]:
    """The folders of ``datasets``' cache that hold the hub dataset ``source`` (its configuration when one is
    named): where ``datasets.load_dataset`` reads it when the hub cannot be reached, as ``datasets`` lays them out
    (``HF_DATASETS_CACHE/<owner>___<name in snake case>/<config>/<version>/<hash>``)."""
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    owner, _, name = source.dataset.partition("/")
    root = Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{camelcase_to_snakecase(name)}"
    return sorted(p for p in root.glob(f"{source.dataset_config or '*'}/*/*") if p.is_dir())


def check_hub_source(source: Source, *, key: str, timeout: float = 10.0) -> str | None:
    """Whether the hub dataset ``source`` can be read on this node, found out at once: the hub is asked once,
    without ``datasets``' retries (half a minute, then a long traceback, on a node without network), and
    ``datasets``' cache is looked at. Returns None when the hub answers for the dataset, and a note when the hub
    cannot be reached but the cache holds the dataset (``datasets`` falls back to it, after its retries unless
    ``HF_HUB_OFFLINE`` is set). With ``HF_HUB_OFFLINE`` only the cache is looked at.

    Raises:
        DataError: one line starting with ``key``: no such dataset on the hub, or neither reachable nor cached,
            with how to download it for this node; or the datasets package is missing.
    """
    if source.kind != "hub":
        raise ValueError(f"{source.dataset!r} is not a hub dataset")
    try:
        import datasets.config
        import huggingface_hub
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:
        raise DataError(f"{key}: {source.dataset!r} is read as a Hugging Face hub name, which needs the datasets "
                        "package (a local path must exist, or start with / or ./)") from None
    name, cache = source.dataset, datasets.config.HF_DATASETS_CACHE
    what = f"{name!r}" + (f" (configuration {source.dataset_config!r})" if source.dataset_config else "")
    cached = hub_cache_folders(source)
    if datasets.config.HF_HUB_OFFLINE:
        if cached:
            return None
        raise DataError(f"{key}: {what} is not in the datasets cache {cache}, and HF_HUB_OFFLINE is set (the hub is "
                        f"not asked); {_hub_fetch_hint(source)}")
    try:
        huggingface_hub.HfApi().dataset_info(name, timeout=timeout)
    except RepositoryNotFoundError:
        raise DataError(f"{key}: the Hugging Face hub has no dataset {name!r} that this node may read (a typo? a "
                        "private or gated one needs `hf auth login` or HF_TOKEN)") from None
    except Exception as error:  # noqa: BLE001 - whatever kept the hub from answering (DNS, proxy, timeout, 5xx)
        why = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        if cached:
            return (f"{key}: the Hugging Face hub is not reachable from this node ({why}); {what} will be read from "
                    f"the datasets cache {cached[-1]} (set HF_HUB_OFFLINE=1 to skip datasets' retries of the hub)")
        raise DataError(f"{key}: {what} is not reachable on the Hugging Face hub from this node ({why}) and not in "
                        f"the datasets cache {cache}; {_hub_fetch_hint(source)}") from None
    return None


def hub_documents(source: Source, *, streaming: bool, skip: int = 0) -> Iterator[str]:
    """Documents of a hub dataset in its stored order, starting after the first ``skip`` documents. A dataset that
    can be neither reached nor read from the cache raises :class:`DataError` (one line, how to download it)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"dataset {source.dataset!r} is read as a Hugging Face hub name, which needs the "
                          "datasets package (a local path must exist, or start with / or ./)") from error
    try:
        data = datasets.load_dataset(source.dataset, source.dataset_config, split=source.split, streaming=streaming)
    except ConnectionError as error:  # datasets' "Couldn't reach ... on the Hub", once its retries are spent
        raise DataError(f"dataset {source.dataset!r}: {' '.join(str(error).split())[:200]}, and it is not in the "
                        f"datasets cache; {_hub_fetch_hint(source)}") from None
    columns = getattr(data, "column_names", None)
    if columns is not None and source.text_field not in columns:
        raise DataError(f"dataset {source.dataset!r}: no text field {source.text_field!r} "
                        f"(columns: {', '.join(columns)}); set data.text_field to the column that holds the text")
    if skip:
        data = data.skip(skip) if hasattr(data, "skip") else data.select(range(skip, len(data)))
    records: Iterable[Any] = data
    for index, record in enumerate(records, start=skip):
        yield _field(record, source.text_field, f"dataset {source.dataset!r} record {index}")
