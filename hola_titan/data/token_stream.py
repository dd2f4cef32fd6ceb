"""The global token stream that packed rows are cut from.

The stream of one epoch is every document's tokens followed by one EOS, documents one after another::

    doc_0 tokens, EOS, doc_1 tokens, EOS, ..., doc_{n-1} tokens, EOS

Epochs follow each other without a gap, so the stream is infinite (training) unless it is limited to one epoch
(validation). Documents that encode to no token are left out. Two implementations:

* :class:`InMemoryTokenStream`, for finite data (the bundled corpus, local files, a downloaded hub split): every
  document is tokenised once into one flat ``int32`` array (cached per process, keyed by the files and the
  tokenizer), so any position is reached by indexing, without re-tokenising. With ``shuffle`` each epoch ``e``
  orders the documents by a permutation drawn from ``(seed, e)`` (a splitmix64 hash of the document index, so the
  order is the same on every machine and NumPy version); without it, the stored order is used.
* :class:`StreamingTokenStream`, for streamed hub data: documents are read and tokenised in stored order (no
  shuffling); it only moves forward, and it resumes from ``(epoch, doc, offset)`` by skipping ``doc`` documents
  without tokenising them and dropping the first ``offset`` tokens of the next one.

Both give ``window(start, length)``: the tokens at stream positions ``[start, start + length)``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from hola_titan.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 512
"""Documents per ``encode_batch`` call."""
_PROGRESS_S = 10.0
"""Seconds between progress lines while tokenising."""

logger = logging.getLogger("hola_titan")

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def epoch_permutation(num_docs: int, *, seed: int, epoch: int) -> np.ndarray:
    """Document order of ``epoch``: indices sorted by a hash of ``(seed, epoch, index)``; machine independent."""
    key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    hashes = _splitmix64(np.arange(num_docs, dtype=np.uint64) ^ key)
    return np.argsort(hashes, kind="stable")


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, *,
                       label: str = "documents") -> tuple[np.ndarray, np.ndarray]:
    """Tokenise documents into ``(tokens, offsets)``: document ``i`` (with its EOS) is
    ``tokens[offsets[i]:offsets[i + 1]]``; documents with no token are left out. Logs its progress every
    ``_PROGRESS_S`` seconds (naming ``label``) when it takes that long, and a summary then."""
    pieces: list[np.ndarray] = []
    chunk: list[str] = []
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    begin = last = time.perf_counter()
    count = [0, 0]  # documents, tokens

    def flush() -> None:
        for ids in tokenizer.encode_batch(chunk):
            if ids:
                pieces.append(np.asarray(ids, dtype=np.int32))
                pieces.append(eos)
                count[1] += len(ids) + 1
        count[0] += len(chunk)
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) == _ENCODE_CHUNK:
            flush()
            if time.perf_counter() - last > _PROGRESS_S:
                last = time.perf_counter()
                logger.info("tokenising %s: %s documents, %s tokens so far (%.0f s)", label, f"{count[0]:,}",
                            f"{count[1]:,}", last - begin)
    flush()
    if time.perf_counter() - begin > _PROGRESS_S:
        logger.info("tokenised %s: %s documents, %s tokens in %.0f s", label, f"{count[0]:,}", f"{count[1]:,}",
                    time.perf_counter() - begin)
    if not pieces:
        return np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)
    lengths = np.array([len(p) for p in pieces], dtype=np.int64).reshape(-1, 2).sum(axis=1)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    return np.concatenate(pieces), offsets


class InMemoryTokenStream:
    """Random-access stream over tokenised finite data (module docstring).

    Args:
        tokens, offsets: from :func:`tokenize_documents`.
        shuffle: order documents by a fresh permutation each epoch.
        seed: seed of the permutations.
        epochs: None for an endless stream; else the stream ends after this many epochs.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, *, shuffle: bool, seed: int,
                 epochs: int | None = None) -> None:
        if len(offsets) < 2 or offsets[-1] == 0:
            raise ValueError("the dataset has no document with at least one token")
        self.tokens = tokens
        self.offsets = offsets
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.epoch_len = int(offsets[-1])
        self.num_docs = len(offsets) - 1
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    @property
    def length(self) -> int | None:
        """Tokens in the whole stream; None when endless."""
        return None if self.epochs is None else self.epochs * self.epoch_len

    def epoch_tokens(self, epoch: int) -> np.ndarray:
        """The stream of one epoch (the two most recent epochs are cached)."""
        if epoch in self._cache:
            self._cache.move_to_end(epoch)
            return self._cache[epoch]
        if not self.shuffle:
            stream = self.tokens
        else:
            order = epoch_permutation(self.num_docs, seed=self.seed, epoch=epoch)
            lengths = np.diff(self.offsets)[order]
            new_starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)[:-1]])
            # For every output position, its source position: old start + (position - new start).
            index = np.repeat(self.offsets[:-1][order] - new_starts, lengths) + np.arange(self.epoch_len)
            stream = self.tokens[index]
        self._cache[epoch] = stream
        if len(self._cache) > 2:
            self._cache.popitem(last=False)
        return stream

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens at positions ``[start, start + length)`` as int64 (may span epochs)."""
        if self.length is not None and start + length > self.length:
            raise IndexError(f"window [{start}, {start + length}) runs past the end of the stream ({self.length})")
        parts = []
        position, remaining = start, length
        while remaining > 0:
            epoch, offset = divmod(position, self.epoch_len)
            take = min(remaining, self.epoch_len - offset)
            parts.append(self.epoch_tokens(epoch)[offset:offset + take])
            position += take
            remaining -= take
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def available(self, end: int) -> bool:
        """Whether positions ``[0, end)`` exist."""
        return self.length is None or end <= self.length

    def resume_point(self, position: int) -> dict[str, int]:
        """Nothing beyond the position is needed to resume random-access data."""
        return {}

    def restore(self, position: int, point: dict[str, int]) -> None:
        """Nothing to do: any position can be read directly."""


class StreamingTokenStream:
    """Forward-only stream over documents read on the fly (module docstring).

    Args:
        open_documents: ``open_documents(skip)`` iterates over one epoch's documents from document ``skip`` on.
        tokenizer: encodes the documents.
        epochs: None for an endless stream (the data is read again from the start after its end).
    """

    def __init__(self, open_documents: Callable[[int], Iterator[str]], tokenizer: Tokenizer, *,
                 epochs: int | None = None) -> None:
        self._open = open_documents
        self._tokenizer = tokenizer
        self.epochs = epochs
        self.restore(0, {"epoch": 0, "doc": 0, "offset": 0})

    def restore(self, position: int, point: dict[str, int]) -> None:
        """Continue so that stream position ``position`` is token ``offset`` of document ``doc`` of ``epoch``."""
        self._epoch = int(point["epoch"])
        self._next_doc = int(point["doc"])
        self._documents = self._open(self._next_doc)
        self._epoch_from_start = self._next_doc == 0
        self._tokens_in_epoch = 0
        # Buffered segments: (stream position of its first token, tokens, epoch, doc index, offset in the doc).
        self._segments: collections.deque[tuple[int, np.ndarray, int, int, int]] = collections.deque()
        self._end = position
        self._fill_one_chunk(drop_first=int(point["offset"]))

    def _fill_one_chunk(self, drop_first: int = 0) -> bool:
        """Tokenise the next documents into the buffer; False at the end of the last epoch."""
        while True:
            texts: list[str] = []
            for text in self._documents:
                texts.append(text)
                if len(texts) == _ENCODE_CHUNK:
                    break
            if texts:
                break
            if self._epoch_from_start and self._tokens_in_epoch == 0:
                raise ValueError("the dataset has no document with at least one token")
            if self.epochs is not None and self._epoch + 1 >= self.epochs:
                return False
            self._epoch, self._next_doc = self._epoch + 1, 0
            self._epoch_from_start, self._tokens_in_epoch = True, 0
            self._documents = self._open(0)
        eos = self._tokenizer.eos_id
        for ids in self._tokenizer.encode_batch(texts):
            doc = self._next_doc
            self._next_doc += 1
            if not ids:
                continue
            tokens = np.asarray(ids + [eos], dtype=np.int64)[drop_first:]
            offset, drop_first = drop_first, 0
            self._segments.append((self._end, tokens, self._epoch, doc, offset))
            self._end += len(tokens)
            self._tokens_in_epoch += len(tokens)
        return True

    def _ensure(self, end: int) -> None:
        while self._end < end:
            if not self._fill_one_chunk():
                raise IndexError(f"position {end} runs past the end of the stream ({self._end})")

    def available(self, end: int) -> bool:
        """Whether positions ``[0, end)`` exist (reads ahead to ``end``)."""
        try:
            self._ensure(end)
        except IndexError:
            return False
        return True

    def _drop_before(self, position: int) -> None:
        while self._segments and self._segments[0][0] + len(self._segments[0][1]) <= position:
            self._segments.popleft()

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens at positions ``[start, start + length)``; ``start`` may not go back before earlier windows."""
        if self._segments and start < self._segments[0][0]:
            raise ValueError(f"a streaming dataset cannot go back to position {start}")
        self._ensure(start + length)
        self._drop_before(start)
        parts = []
        for seg_start, tokens, *_ in self._segments:
            if seg_start >= start + length:
                break
            parts.append(tokens[max(0, start - seg_start):start + length - seg_start])
        return np.concatenate(parts)

    def resume_point(self, position: int) -> dict[str, int]:
        """``(epoch, doc, offset)`` of the token at ``position`` (reads ahead to it if needed)."""
        self._ensure(position + 1)
        self._drop_before(position)
        seg_start, _, epoch, doc, offset = self._segments[0]
        return {"epoch": epoch, "doc": doc, "offset": offset + position - seg_start}
