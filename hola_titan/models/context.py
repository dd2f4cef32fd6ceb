"""What one batch's forward needs besides its tokens: made once per batch, immutable, passed through ``forward``.

Nothing about a batch lives in module attributes or process globals: the trainer (or any caller) builds a
:class:`BatchContext` per batch and the model hands it to every layer, so a forward re-run during backward
(activation checkpointing) sees exactly the context it saw the first time, and two models or two batches in
flight cannot see each other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hola_titan.kernels.runtime.documents import Documents


@dataclass(frozen=True)
class BatchContext:
    """``documents``: the boundaries of packed documents over the flattened batch (None: every row is one
    sequence). ``cp``: this rank's view of a context-parallel batch, or None; it is made by
    ``hola_titan.parallelisms.context_parallel.ContextParallel.batch`` and the model only calls its methods
    (``layer(...)`` for a recurrent mixer's handover, ``causal_attention`` and ``shard_start`` for Transformer++), so
    model code stays free of ``torch.distributed``."""

    documents: Documents | None = None
    cp: Any = None

    def __post_init__(self):
        if self.documents is not None and not isinstance(self.documents, Documents):
            raise ValueError(f"documents: expected a Documents, got {type(self.documents).__name__}")


NO_CONTEXT = BatchContext()
