"""Packed rows -> a training batch: ``input_ids``, ``labels``, ``position_ids`` and (varlen) ``cu_seqlens``.

Row layout. The token stream (``token_stream``) is every document followed by one EOS. Global row ``j`` is the
window of ``T + 1`` stream tokens at positions ``[j*T, j*T + T]`` (``T = seq_len``): consecutive rows overlap by one
token, so the inputs of consecutive rows tile the stream and every stream token after the first is a target
exactly once::

    input_ids[t] = stream[j*T + t]        labels[t] = stream[j*T + t + 1]        t = 0 .. T-1

Document boundaries (``varlen=True``, DESIGN §2, packed documents). The EOS belongs to the document it ends.
Position ``t`` of a row starts a document when ``t == 0`` (every row start is treated as a document start, even in
the middle of a document) or when ``input_ids[t - 1]`` is EOS. Then:

* ``labels[t] = -100`` (ignored) exactly where ``input_ids[t]`` is EOS: that target is the first token of the next
  document, predicted from the previous document's last position. The EOS itself stays a target (predicted from
  the last text token of its document), so the model learns where documents end. A row start in the middle of a
  document ignores no label.
* ``cu_seqlens`` (int32, ``[N + 1]``) lists the document starts over the flattened ``B*T`` batch: every row start
  ``b*T``, every ``b*T + t`` after an EOS, and ``B*T`` at the end; strictly increasing.
* ``position_ids[b, t]`` counts from 0 at each document start.

Example, ``T = 6``, one row ``[a1 a2 EOS b1 b2 EOS | c1]``::

    input_ids    a1  a2  EOS  b1  b2  EOS
    labels       a2  EOS -100 b2  EOS -100      (b1 and c1 start documents)
    position_ids 0   1   2    0   1   2
    cu_seqlens   [0, 3, 6]

``varlen=False`` treats every row as one causal sequence: no ``cu_seqlens`` key, no ignored label (the EOS -> next
document target is trained on), ``position_ids[b, t] = t``.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label value the loss ignores (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


class RowLoader:
    """What the packed-text and synthetic loaders share: a global batch of ``dp_world_size * local_batch_size``
    rows, and a length only when the loader is finite (validation; ``num_batches`` rows of batches)."""

    dp_world_size: int
    local_batch_size: int
    num_batches: int | None

    @property
    def global_batch_rows(self) -> int:
        """Rows of one global batch, ``dp_world_size * local_batch_size``."""
        return self.dp_world_size * self.local_batch_size

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("a training loader is endless and has no length")
        return self.num_batches


class Batch(TypedDict):
    """One local batch; ``B = local_batch_size``, ``T = seq_len``."""

    input_ids: torch.Tensor
    """int64 ``[B, T]``."""
    labels: torch.Tensor
    """int64 ``[B, T]``; ``-100`` where ignored."""
    position_ids: torch.Tensor
    """int64 ``[B, T]``; restarts at 0 at each document start (varlen) or ``arange(T)`` per row."""
    cu_seqlens: NotRequired[torch.Tensor]
    """int32 ``[N + 1]``, varlen only: document starts over the flattened ``B*T`` tokens, then ``B*T``."""


def document_starts(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Boolean ``[B, T]``: True where a document starts (each row start, and after each EOS)."""
    starts = np.zeros(input_ids.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return starts


def pack_rows(rows: np.ndarray, *, eos_id: int, varlen: bool) -> Batch:
    """Build a :class:`Batch` from ``rows``, an integer array ``[B, T + 1]`` of stream windows (module docstring).

    Raises:
        ValueError: ``rows`` is not two-dimensional with at least two columns.
    """
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must have shape [B, seq_len + 1] with seq_len >= 1, got {tuple(rows.shape)}")
    rows = rows.astype(np.int64, copy=False)
    input_ids = rows[:, :-1].copy()
    labels = rows[:, 1:].copy()
    batch_size, seq_len = input_ids.shape
    if not varlen:
        positions = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (batch_size, seq_len)).copy()
        return Batch(input_ids=torch.from_numpy(input_ids), labels=torch.from_numpy(labels),
                     position_ids=torch.from_numpy(positions))

    labels[input_ids == eos_id] = IGNORE_INDEX
    starts = document_starts(input_ids, eos_id)
    index = np.arange(seq_len, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    positions = index - last_start
    cu_seqlens = np.append(np.flatnonzero(starts.reshape(-1)), batch_size * seq_len).astype(np.int32)
    return Batch(input_ids=torch.from_numpy(input_ids), labels=torch.from_numpy(labels),
                 position_ids=torch.from_numpy(positions), cu_seqlens=torch.from_numpy(cu_seqlens))
