"""The HOLA cache object: everything a sequence needs to continue exactly where a call stopped.

Shape legend: N sequences (batch rows, or documents with ``cu_seqlens``), H heads, W = window, C = block,
D = head dim.

Per sequence and head the cache holds
- the persistent top-W entries: ``scores`` [N, H, W] (the surprise score m, float32 or float64),
  ``positions`` [N, H, W] (absolute positions in the sequence, -1 marks an empty slot), ``k`` and ``v``
  [N, H, W, D] (k before the RMSNorm, so gradients reach ``gamma_k`` however the cache was built);
- the unfinished block: ``buf_scores`` [N, H, C], ``buf_k`` / ``buf_v`` [N, H, C, D]; the first
  ``seen % C`` slots are the tokens at positions ``seen - seen % C ...  seen - 1``, the rest is empty;
- ``seen`` [N]: how many tokens of the sequence were processed.

Blocks are aligned to the sequence start, so ``seen % C`` tells how far into its block the sequence is.
The entries are kept in selection order (key descending, then position ascending; empty slots last),
where the key is the score (``evict="score"``) or the position (``evict="recency"``). Memory is constant in
the sequence length: (W + C) entries per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HolaCache:
    """Top-W entries and the unfinished block of every sequence and head (see the module docstring)."""

    scores: torch.Tensor
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    buf_scores: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    seen: torch.Tensor
    window: int
    block: int
    evict: str

    # The layout, public: the tensors (in this order, sequences first in every one) and the metadata. Code that
    # moves a cache (decoding buffers, context-parallel messages, generation's row selection) goes through
    # flatten / unflatten / map_tensors / cat instead of naming the fields.
    TENSORS = ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v", "seen")
    META = ("window", "block", "evict")
    ROWS = ("k", "v", "buf_k", "buf_v")  # token rows, in the activations' dtype, differentiable
    SCORES = ("scores", "buf_scores")  # float32 or float64, never differentiated (selection is discrete)
    INTEGER = ("positions", "seen")  # int64

    @staticmethod
    def shapes(*, num_seqs: int, num_heads: int, head_dim: int, window: int, block: int) -> dict[str, tuple]:
        """The shape of every tensor, by name, for these sizes."""
        n, h, d, w, c = num_seqs, num_heads, head_dim, window, block
        return {"scores": (n, h, w), "positions": (n, h, w), "k": (n, h, w, d), "v": (n, h, w, d),
                "buf_scores": (n, h, c), "buf_k": (n, h, c, d), "buf_v": (n, h, c, d), "seen": (n,)}

    @classmethod
    def empty(cls, num_seqs: int, num_heads: int, head_dim: int, *, window: int, block: int, evict: str,
              dtype: torch.dtype, device: torch.device | str, score_dtype: torch.dtype = torch.float32) -> HolaCache:
        """A cache with no tokens seen: what a sequence starts from."""
        n, h, w, c, d = num_seqs, num_heads, window, block, head_dim
        return cls(
            scores=torch.full((n, h, w), float("-inf"), dtype=score_dtype, device=device),
            positions=torch.full((n, h, w), -1, dtype=torch.int64, device=device),
            k=torch.zeros(n, h, w, d, dtype=dtype, device=device),
            v=torch.zeros(n, h, w, d, dtype=dtype, device=device),
            buf_scores=torch.full((n, h, c), float("-inf"), dtype=score_dtype, device=device),
            buf_k=torch.zeros(n, h, c, d, dtype=dtype, device=device),
            buf_v=torch.zeros(n, h, c, d, dtype=dtype, device=device),
            seen=torch.zeros(n, dtype=torch.int64, device=device),
            window=window, block=block, evict=evict,
        )

    @property
    def num_seqs(self) -> int:
        return self.seen.shape[0]

    @property
    def num_heads(self) -> int:
        return self.scores.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    def flatten(self) -> list[torch.Tensor]:
        """The tensors in :attr:`TENSORS` order (:meth:`unflatten` rebuilds the cache with :meth:`meta`)."""
        return [getattr(self, name) for name in self.TENSORS]

    def meta(self) -> dict:
        return {name: getattr(self, name) for name in self.META}

    @classmethod
    def unflatten(cls, tensors: list[torch.Tensor], meta: dict) -> HolaCache:
        if len(tensors) != len(cls.TENSORS):
            raise ValueError(f"cache: a HolaCache has {len(cls.TENSORS)} tensors, got {len(tensors)}")
        return cls(**dict(zip(cls.TENSORS, tensors)), **meta)

    def map_tensors(self, fn) -> HolaCache:
        """A cache whose tensors are ``fn(tensor)``; the metadata is kept."""
        return self.unflatten([fn(t) for t in self.flatten()], self.meta())

    def detach(self) -> HolaCache:
        return self.map_tensors(torch.Tensor.detach)

    def select(self, index: torch.Tensor) -> HolaCache:
        """The sequences ``index`` (e.g. to reorder a batch during generation)."""
        return self.map_tensors(lambda t: t.index_select(0, index))

    @staticmethod
    def cat(caches: list[HolaCache]) -> HolaCache:
        """Concatenate the sequences of several caches with the same metadata."""
        first = caches[0]
        for other in caches[1:]:
            if (other.window, other.block, other.evict) != (first.window, first.block, first.evict):
                raise ValueError("initial_cache: caches to concatenate differ in window, block or evict")
        return HolaCache.unflatten([torch.cat(parts) for parts in zip(*(c.flatten() for c in caches))], first.meta())

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant in the sequence length)."""
        return sum(t.numel() * t.element_size() for t in self.flatten())

    def check_matches(self, *, num_seqs: int, num_heads: int, head_dim: int, window: int, block: int,
                      evict: str) -> None:
        """Raise ``ValueError`` naming ``initial_cache`` when this cache cannot continue the given call."""
        expected = dict(window=window, block=block, evict=evict)
        actual = dict(window=self.window, block=self.block, evict=self.evict)
        if expected != actual:
            raise ValueError(f"initial_cache: built with {actual}, but the call uses {expected}")
        shapes = self.shapes(num_seqs=num_seqs, num_heads=num_heads, head_dim=head_dim, window=window, block=block)
        for name, shape in shapes.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"initial_cache: {name} has shape {list(got)}, expected {list(shape)} "
                                 f"for {num_seqs} sequences, {num_heads} heads, head dim {head_dim}")
        if self.positions.dtype != torch.int64 or self.seen.dtype != torch.int64:
            raise ValueError("initial_cache: positions and seen must be int64")
