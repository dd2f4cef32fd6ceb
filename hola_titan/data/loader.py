"""Data loaders over one global, deterministic stream of packed rows, sharded by data-parallel rank.

Global order. Rows ``0, 1, 2, ...`` are cut from the token stream as described in ``packing`` (row ``j`` = stream
positions ``[j*T, j*T + T]``). The stream, hence every row, depends only on the dataset, the tokenizer, and (for
finite data with ``shuffle``) the seed; not on the number of ranks.

Sharding. With ``dp_world_size = W`` and ``local_batch_size = b``, the ``i``-th batch of data-parallel rank ``r``
holds the global rows ``i*W*b + r*b .. i*W*b + r*b + b - 1``: global batch ``i`` is rows ``[i*W*b, (i+1)*W*b)``,
split in rank order, so the ranks of one step together see exactly the rows that one process with batch ``W*b``
would see. Context- and tensor-parallel ranks of one data-parallel group pass the same ``dp_rank`` and read the
same rows.

State and resume. :meth:`PackedDataLoader.state_dict` counts the *global* rows consumed (``(i+1)*W*b`` after a rank
has received its ``i``-th batch; the same on every rank), so a checkpoint resumes at any data-parallel degree or
batch size at the same global row: a run that continues at ``W = 1`` after ``W = 2`` consumed ``2*b*i`` rows goes
on at row ``2*b*i``. The state also holds ``seq_len``, the seed and ``shuffle`` (a mismatch on load is an error, because
rows would mean something else) and, for streamed hub data, the ``(epoch, doc, offset)`` of the next row start so that
resuming skips documents instead of re-tokenising them. The object follows the ``state_dict()`` /
``load_state_dict()`` protocol of torchdata's ``StatefulDataLoader`` and of ``torch.distributed.checkpoint``'s
``Stateful``; all work happens in the calling process (there are no worker processes), which makes resume exact.
The state changes when a batch is handed out, so a state saved after receiving ``k`` batches resumes with batch
``k``; iterating the loader again also continues from there.

Training loaders (:func:`build_dataloader`) are endless: finite data repeats epoch after epoch (reshuffled per
epoch when ``shuffle``). Validation loaders (:func:`build_validation_dataloader`) read the first epoch of the
held-out data in stored order and yield the same batches every time they are iterated.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hola_titan.config import Data
from hola_titan.data.packing import Batch, RowLoader, pack_rows
from hola_titan.data.fingerprint import fingerprint_changes, source_fingerprint
from hola_titan.data.sources import DataError, Source, TxtDocuments, hub_documents, read_documents, resolve_source
from hola_titan.data.synthetic import MqarLoader, build_synthetic_dataloader, is_synthetic
from hola_titan.data.token_stream import InMemoryTokenStream, StreamingTokenStream, tokenize_documents
from hola_titan.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TokenStream = InMemoryTokenStream | StreamingTokenStream

_STATE_VERSION = 1
_TOKEN_CACHE: collections.OrderedDict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
_TOKEN_CACHE_SIZE = 4
"""Tokenised finite datasets kept per process (loaders over the same data and tokenizer share one)."""


class PackedDataLoader(RowLoader):
    """Yields :class:`~hola_titan.data.packing.Batch` dicts for one data-parallel rank (module docstring).

    Build it with :func:`build_dataloader` or :func:`build_validation_dataloader`.

    Args:
        stream: the global token stream.
        seq_len: tokens per row ``T``.
        local_batch_size: rows per batch on this rank ``b``.
        dp_rank, dp_world_size: data-parallel rank ``r`` and degree ``W``.
        eos_id: document separator id.
        varlen: emit document boundaries (``cu_seqlens``, ignored cross-document labels).
        seed: recorded in the state (it decides the document order of shuffled data).
        num_batches: None: endless and stateful (training); an int: every iteration yields the same first
            ``num_batches`` batches (validation).
        accumulation: with ``num_batches``, the local batches that make one validation batch (the run's
            gradient-accumulation steps): iteration stops only at a whole one of them.
        holdout: the source's hold-out (``Source.holdout_tag``), recorded and checked on resume.
    """

    def __init__(self, stream: TokenStream, *, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, eos_id: int, varlen: bool, seed: int, num_batches: int | None = None,
                 accumulation: int = 1, holdout: str = "none", fingerprint: dict | None = None,
                 allow_changed_data: bool = False) -> None:
        if accumulation < 1 or (num_batches is not None and num_batches % accumulation):
            raise ValueError(f"accumulation must be >= 1 and divide num_batches {num_batches}, got {accumulation}")
        self.stream = stream
        self.accumulation = accumulation
        self.holdout = holdout
        self.fingerprint = fingerprint
        self.allow_changed_data = allow_changed_data
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.eos_id = eos_id
        self.varlen = varlen
        self.seed = seed
        self.num_batches = num_batches
        self.shuffle = bool(getattr(stream, "shuffle", False))
        self.global_rows_consumed = 0
        self._resume_point: dict[str, int] = {}

    def _batch_at(self, first_global_row: int) -> Batch:
        """The local batch whose global batch starts at ``first_global_row``."""
        first = first_global_row + self.dp_rank * self.local_batch_size
        seq_len = self.seq_len
        window = self.stream.window(first * seq_len, self.local_batch_size * seq_len + 1)
        rows = np.lib.stride_tricks.sliding_window_view(window, seq_len + 1)[::seq_len]
        return pack_rows(rows, eos_id=self.eos_id, varlen=self.varlen)

    def __iter__(self) -> Iterator[Batch]:
        if self.num_batches is not None:
            if isinstance(self.stream, StreamingTokenStream):
                self.stream.restore(0, {"epoch": 0, "doc": 0, "offset": 0})
            for index in range(self.num_batches):
                # Stop on every rank at the first validation batch (``accumulation`` global batches of the loader)
                # that does not fit (streamed data may be shorter): what is read then does not depend on the layout.
                end = index + self.accumulation
                if index % self.accumulation == 0 and not self.stream.available(
                        end * self.global_batch_rows * self.seq_len + 1):
                    return
                yield self._batch_at(index * self.global_batch_rows)
            return
        while True:
            batch = self._batch_at(self.global_rows_consumed)
            self.global_rows_consumed += self.global_batch_rows
            # Streams that only move forward read up to the next global batch here, on every rank, so that the
            # state names a position that any data-parallel degree can resume from.
            self._resume_point = self.stream.resume_point(self.global_rows_consumed * self.seq_len)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``global_rows_consumed`` (plus checks and the streaming position); identical on every rank."""
        return {
            "version": _STATE_VERSION,
            "global_rows_consumed": self.global_rows_consumed,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "holdout": self.holdout,
            # One string: DCP would spread a nested structure over keys of its own.
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            **{f"stream_{key}": value for key, value in self._resume_point.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after the rows a saved state had consumed; any ``dp_world_size`` or batch size.

        Raises:
            ValueError: the state was saved with another ``seq_len``, seed or shuffle setting, or is not a loader
                state.
        """
        if "global_rows_consumed" not in state_dict:
            raise ValueError(f"not a PackedDataLoader state (keys: {sorted(state_dict)})")
        for key in ("seq_len", "seed", "shuffle"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(f"data loader state was saved with {key}={state_dict.get(key)}, this loader has "
                                 f"{key}={getattr(self, key)}")
        saved_holdout = state_dict.get("holdout", "none")  # states from before the hold-out had none
        if saved_holdout != self.holdout:
            raise ValueError(f"data.holdout_every: the checkpoint's run read the documents with hold-out "
                             f"{saved_holdout}, this run with {self.holdout} (another document stream); set "
                             "data.holdout_every to what the run used (0 for a run from before the hold-out)")
        self._check_fingerprint(state_dict.get("fingerprint"))
        rows = int(state_dict["global_rows_consumed"])
        point = {key[len("stream_"):]: int(value) for key, value in state_dict.items() if key.startswith("stream_")}
        if isinstance(self.stream, StreamingTokenStream):
            if not point:
                if rows > 0:
                    raise ValueError("data loader state has no streaming position (it was saved from finite data)")
                point = {"epoch": 0, "doc": 0, "offset": 0}
            self.stream.restore(rows * self.seq_len, point)
        self.global_rows_consumed = rows
        self._resume_point = point


    def _check_fingerprint(self, saved_text: str | None) -> None:
        """Refuse (``ValueError``) to resume a position in documents that changed since they were read, unless
        ``allow_changed_data``; say it when only modification times moved."""
        saved = json.loads(saved_text) if saved_text else None
        if saved is None or self.fingerprint is None:
            if self.fingerprint is not None:
                logger.warning("data: the checkpoint records no fingerprint of its data (an earlier version wrote "
                               "it): whether %s changed since cannot be checked", self.fingerprint.get("dataset"))
            return
        changes, touched, by_ends = fingerprint_changes(saved, self.fingerprint)
        if changes:
            what = "; ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
            if not self.allow_changed_data:
                raise ValueError(f"data.dataset: {self.fingerprint.get('dataset')} changed since the checkpoint's "
                                 f"run read it ({what}): resuming would continue at row {self.global_rows_consumed} "
                                 "of another document stream; restore the data, or set data.allow_changed_data = "
                                 "true to continue on the new data")
            logger.warning("data: %s changed since the checkpoint's run read it (%s); continuing on the new data "
                           "(data.allow_changed_data)", self.fingerprint.get("dataset"), what)
        elif touched:
            logger.info("data: %d file(s) of %s have new modification times but the same content (copied?), "
                        "e.g. %s", len(touched), self.fingerprint.get("dataset"), touched[0])
        if by_ends and not changes:
            logger.warning("data: the checkpoint was written before data fingerprints held content hashes: %d file(s) "
                           "of %s could not be compared by content, only by size and their first and last MiB, "
                           "e.g. %s; the next checkpoint records their hashes", len(by_ends),
                           self.fingerprint.get("dataset"), by_ends[0])


# ---------------------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------------------


def repetition_note(loader, *, steps: int, rows_per_step: int) -> str | None:
    """What ``steps`` optimizer steps of ``rows_per_step`` global rows do to a finite dataset, when they repeat it:
    one sentence for the start-up log (``None`` when the data is not repeated or its length is not known ahead, as
    for streamed and synthetic data)."""
    stream = getattr(loader, "stream", None)
    epoch_len = getattr(stream, "epoch_len", None)
    if not isinstance(loader, PackedDataLoader) or not epoch_len or getattr(stream, "epochs", None) is not None:
        return None
    batch_tokens = rows_per_step * loader.seq_len
    passes = steps * batch_tokens / epoch_len
    if batch_tokens > epoch_len:
        return (f"the training data holds {epoch_len:,} tokens, fewer than one global batch "
                f"({rows_per_step} rows x {loader.seq_len} tokens = {batch_tokens:,}): every batch repeats it, "
                f"{passes:,.1f} passes over it in {steps} steps")
    if passes > 1:
        return (f"the training data holds {epoch_len:,} tokens: {steps} steps of {batch_tokens:,} read it "
                f"{passes:,.1f} times (epochs {'reshuffled' if loader.shuffle else 'in the same order'})")
    return None


def _check_args(*, tokenizer: Tokenizer, seq_len: int, local_batch_size: int, dp_rank: int,
                dp_world_size: int) -> None:
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"tokenizer must be a hola_titan.data.Tokenizer (see load_tokenizer), got "
                         f"{type(tokenizer).__name__}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if dp_world_size < 1:
        raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")


_DISK_FORMAT = "hola_titan.tokens/1"


def _disk_cache_file(token_cache: Path, key: tuple[Any, ...]) -> Path:
    digest = hashlib.sha256(repr((_DISK_FORMAT, key)).encode()).hexdigest()[:32]
    return token_cache / f"{digest}.npz"


def _read_disk_cache(path: Path, label: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached ``(tokens, offsets)``, or None when there is none; a file that cannot be read (a process killed
    while another wrote it cannot leave one: writes are renamed into place) is named in a warning and replaced."""
    if not path.is_file():
        return None
    begin = time.perf_counter()
    try:
        with np.load(path) as data:
            if str(data["format"]) != _DISK_FORMAT:
                raise ValueError(f"format {data['format']}")
            tokens, offsets = data["tokens"].astype(np.int32), data["offsets"].astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != len(tokens):
            raise ValueError("offsets do not span the tokens")
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        logger.warning("token cache %s for %s cannot be read (%s): tokenising again", path, label, err)
        return None
    logger.info("tokens of %s read from the token cache %s: %s documents, %s tokens in %.1f s", label, path,
                f"{len(offsets) - 1:,}", f"{len(tokens):,}", time.perf_counter() - begin)
    return tokens, offsets


def _write_disk_cache(path: Path, tokens: np.ndarray, offsets: np.ndarray, label: str) -> None:
    """Write atomically (a temporary file renamed into place), so readers see a whole file or none; ranks or runs
    that tokenised the same data at once write the same bytes. A cache that cannot be written costs the next
    process the tokenising again, not this run: a warning."""
    stored = tokens.astype(np.uint16) if len(tokens) == 0 or int(tokens.max()) < 1 << 16 else tokens
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, format=np.array(_DISK_FORMAT), tokens=stored, offsets=offsets)
        os.replace(tmp, path)
    except OSError as err:
        logger.warning("token cache %s for %s not written (%s): the next process tokenises again", path, label,
                       err)
        tmp.unlink(missing_ok=True)
        return
    logger.info("tokens of %s written to the token cache %s (%.0f MB)", label, path, path.stat().st_size / 1e6)


def _tokenized(source: Source, tokenizer: Tokenizer, *, streaming: bool, fingerprint: dict[str, Any],
               token_cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise a finite source once per process (cached by files, fields and tokenizer), and once per node for
    bundled and local data when ``token_cache`` names a folder (``data.token_cache``). ``fingerprint``: the
    source's (:func:`~hola_titan.data.fingerprint.source_fingerprint`): files are keyed by their content hash, so
    that a file edited in place is tokenised again whatever its size and modification time."""
    if source.kind == "hub":
        key: tuple[Any, ...] = (source.kind, source.dataset, source.dataset_config, source.split,
                                source.text_field)
        documents = hub_documents(source, streaming=streaming)
    else:
        files = tuple((f["path"], f["size"], f["sha256"]) for f in fingerprint["files"])
        key = (source.kind, source.dataset, source.split, source.text_field, source.dataset_config,
               source.txt_documents, files, source.holdout_tag)
        documents = read_documents(source)
    key = (*key, tokenizer.fingerprint)
    if key not in _TOKEN_CACHE:
        label = source.dataset if source.kind != "local" or len(source.files) != 1 else str(source.files[0])
        label = f"{label} ({source.split})"
        # Hub data is left to datasets' own cache: its name does not pin a revision, so a key could go stale.
        disk = _disk_cache_file(token_cache, key) if token_cache is not None and source.kind != "hub" else None
        found = _read_disk_cache(disk, label) if disk is not None else None
        if found is None:
            found = tokenize_documents(documents, tokenizer, label=label)
            if disk is not None:
                _write_disk_cache(disk, *found, label)
        _TOKEN_CACHE[key] = found
        if len(_TOKEN_CACHE) > _TOKEN_CACHE_SIZE:
            _TOKEN_CACHE.popitem(last=False)
    _TOKEN_CACHE.move_to_end(key)
    return _TOKEN_CACHE[key]


def _build_stream(source: Source, tokenizer: Tokenizer, *, streaming: bool | None, shuffle: bool, seed: int,
                  epochs: int | None, token_cache: Path | None, fingerprint: dict[str, Any]) -> TokenStream:
    stream_hub = source.kind == "hub" and (streaming is None or streaming)
    if stream_hub:
        def open_documents(skip: int) -> Iterator[str]:
            return hub_documents(source, streaming=True, skip=skip)
        return StreamingTokenStream(open_documents, tokenizer, epochs=epochs)
    tokens, offsets = _tokenized(source, tokenizer, streaming=False, fingerprint=fingerprint,
                                 token_cache=token_cache)
    if len(offsets) < 2 or offsets[-1] == 0:
        files = ", ".join(str(f) for f in source.files[:3]) + (" ..." if len(source.files) > 3 else "")
        raise DataError(f"data.dataset: {source.dataset!r} split {source.split!r} ({files}) has no document with at "
                        "least one token: is the file empty, or is the text under another field (data.text_field)?")
    return InMemoryTokenStream(tokens, offsets, shuffle=shuffle, seed=seed, epochs=epochs)


def build_dataloader(*, data: Data, tokenizer: Tokenizer, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                     dp_world_size: int = 1, seed: int = 0, shuffle: bool = True,
                     txt_documents: TxtDocuments = "paragraph", token_cache: Path | None = None,
                     hash_cache: Path | None = None) -> PackedDataLoader | MqarLoader:
    """Endless, resumable training loader for one data-parallel rank (module docstring).

    Args:
        data: the config's ``[data]`` section (``hola_titan.config.Data``): ``dataset`` (``"bundled"``, a local
            file/folder/glob, a hub name: ``hola_titan.data.sources``; or a synthetic token source ``"mqar:..."``:
            ``hola_titan.data.synthetic``), the ``split`` to read, its ``text_field`` and ``dataset_config``,
            ``streaming`` (hub data: stream when True or None, else download the split and shuffle it like local
            data; bundled and local data are always held in memory), ``varlen`` (document boundaries in each batch:
            ``hola_titan.data.packing``), ``holdout_every`` (local data without split folders: every N-th document
            is held out for validation and never read here; 0: none) and ``allow_changed_data`` (resume from a
            checkpoint whose data's fingerprint, kept in the loader's state, differs from the data now, with a
            warning, instead of refusing).
        tokenizer: from :func:`~hola_titan.data.tokenizer.load_tokenizer`.
        seq_len: tokens per row ``T``.
        local_batch_size: rows per batch on this rank.
        dp_rank, dp_world_size: data-parallel rank and degree (not the context- or tensor-parallel ones).
        seed: document order of each epoch when ``shuffle``.
        shuffle: reshuffle the documents of finite data every epoch; streamed hub data is always read in order.
        txt_documents: ``.txt`` files: ``paragraph`` (blank-line separated blocks) or ``file``.
        token_cache: a folder that keeps the tokenised documents of bundled and local data for the next process
            (``data.token_cache``; the trainer passes ``job.cache_folder``/``tokens``); None: tokenise here.
        hash_cache: a folder that keeps the content hashes of bundled and local data files for the node's next
            process (:mod:`hola_titan.data.fingerprint`; the trainer passes ``job.cache_folder``/``data_hashes``);
            None: hash the files in this process.
    """
    _check_args(tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                dp_world_size=dp_world_size)
    if is_synthetic(data.dataset):
        return build_synthetic_dataloader(data.dataset, vocab_size=tokenizer.vocab_size, seq_len=seq_len,
                                          local_batch_size=local_batch_size, dp_rank=dp_rank,
                                          dp_world_size=dp_world_size, seed=seed, split=data.split)
    source = resolve_source(data.dataset, split=data.split, text_field=data.text_field,
                            dataset_config=data.dataset_config, txt_documents=txt_documents,
                            holdout_every=data.holdout_every)
    fingerprint = source_fingerprint(source, hash_cache=hash_cache)
    stream = _build_stream(source, tokenizer, streaming=data.streaming, shuffle=shuffle, seed=seed, epochs=None,
                           token_cache=token_cache, fingerprint=fingerprint)
    return PackedDataLoader(stream, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                            dp_world_size=dp_world_size, eos_id=tokenizer.eos_id, varlen=data.varlen, seed=seed,
                            holdout=source.holdout_tag, fingerprint=fingerprint,
                            allow_changed_data=data.allow_changed_data)


def build_validation_dataloader(*, data: Data, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                                dp_rank: int = 0, dp_world_size: int = 1, dataset: str | None = None,
                                split: str = "validation", max_batches: int | None = None, accumulation: int = 1,
                                txt_documents: TxtDocuments = "paragraph", token_cache: Path | None = None,
                                hash_cache: Path | None = None) -> PackedDataLoader | MqarLoader:
    """Loader over fixed held-out rows: the first epoch of ``split`` in stored order, the same every iteration.

    ``dataset``: a separate validation dataset (``validation.dataset``), read whole; None (or ``data.dataset``):
    ``data.dataset``, of which local data without split folders gives the documents ``data.holdout_every`` holds
    out. ``data.split`` and ``data.allow_changed_data`` concern the training loader and are not read here.

    A validation batch is one global batch of the run, ``dp_world_size x local_batch_size x accumulation`` rows
    (``accumulation``: the run's gradient-accumulation steps), handed out as ``accumulation`` local batches in a
    row. Validation batch ``i`` is global rows ``[i*R, (i+1)*R)`` whatever the layout, so the rows read, hence the
    loss, depend on the global batch alone, as training's do. It yields ``min(max_batches, whole validation
    batches in one epoch)`` of them, ``len()`` counting local batches (``max_batches`` is required for streamed
    hub data, whose length is unknown; it may end sooner); every rank yields the same number. Other arguments as
    in :func:`build_dataloader`.

    Raises:
        DataError: the split holds fewer rows than one validation batch (streamed data is read that far to know).
        ValueError: ``max_batches`` is missing for streamed data.
    """
    # The hold-out belongs to the training data: a separate dataset has none of it.
    holdout_every = data.holdout_every if dataset in (None, data.dataset) else None
    dataset = dataset or data.dataset
    _check_args(tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                dp_world_size=dp_world_size)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation}")
    if is_synthetic(dataset):
        # Rows are drawn by their global index: the first max_batches validation batches are layout-independent.
        return build_synthetic_dataloader(dataset, vocab_size=tokenizer.vocab_size, seq_len=seq_len,
                                          local_batch_size=local_batch_size, dp_rank=dp_rank,
                                          dp_world_size=dp_world_size, seed=0, split=split,
                                          num_batches=None if max_batches is None else max_batches * accumulation,
                                          validation=True)
    source = resolve_source(dataset, split=split, text_field=data.text_field, dataset_config=data.dataset_config,
                            txt_documents=txt_documents, holdout_every=holdout_every)
    stream = _build_stream(source, tokenizer, streaming=data.streaming, shuffle=False, seed=0, epochs=1,
                           token_cache=token_cache, fingerprint=source_fingerprint(source, hash_cache=hash_cache))
    batch_rows = dp_world_size * local_batch_size * accumulation

    def too_small(holds: str) -> DataError:
        return DataError(f"validation data {dataset!r} split {split!r} ({source.holdout_tag} hold-out) {holds}, "
                         f"fewer than one global batch of {batch_rows} rows x {seq_len} tokens; lower "
                         "data.holdout_every, or use validation.dataset")

    if isinstance(stream, InMemoryTokenStream):
        # Row j needs stream positions up to j*T + T, inside the single epoch.
        available_rows = (stream.epoch_len - 1) // seq_len
        num_batches = available_rows // batch_rows
        if num_batches == 0:
            raise too_small(f"has {stream.epoch_len} tokens")
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
    elif max_batches is None:
        raise ValueError(f"validation on streamed data {dataset!r} needs max_batches")
    else:
        # Its length is unknown: read as far as one validation batch now, so that a split too small for one is
        # found when the loader is built (before training), not at the first validation.
        if not stream.available(batch_rows * seq_len + 1):
            raise too_small("ends sooner (streamed)")
        num_batches = max_batches
    return PackedDataLoader(stream, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                            dp_world_size=dp_world_size, eos_id=tokenizer.eos_id, varlen=data.varlen, seed=0,
                            num_batches=num_batches * accumulation, accumulation=accumulation,
                            holdout=source.holdout_tag)
