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

from dataclasses import dataclass, fields

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

    _TENSORS = ("scores", "positions", "k", "v", "buf_scores", "buf_k", "buf_v", "seen")

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

    def map_tensors(self, fn) -> HolaCache:
        """A cache whose tensors are ``fn(tensor)``; the metadata is kept."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in self._TENSORS:
            values[name] = fn(values[name])
        return HolaCache(**values)

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
        values = {f.name: getattr(first, f.name) for f in fields(first)}
        for name in HolaCache._TENSORS:
            values[name] = torch.cat([getattr(c, name) for c in caches], dim=0)
        return HolaCache(**values)

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant in the sequence length)."""
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self._TENSORS)

    def check_matches(self, *, num_seqs: int, num_heads: int, head_dim: int, window: int, block: int,
                      evict: str) -> None:
        """Raise ``ValueError`` naming ``initial_cache`` when this cache cannot continue the given call."""
        expected = dict(window=window, block=block, evict=evict)
        actual = dict(window=self.window, block=self.block, evict=self.evict)
        if expected != actual:
            raise ValueError(f"initial_cache: built with {actual}, but the call uses {expected}")
        shapes = {
            "scores": (num_seqs, num_heads, window), "positions": (num_seqs, num_heads, window),
            "k": (num_seqs, num_heads, window, head_dim), "v": (num_seqs, num_heads, window, head_dim),
            "buf_scores": (num_seqs, num_heads, block), "buf_k": (num_seqs, num_heads, block, head_dim),
            "buf_v": (num_seqs, num_heads, block, head_dim), "seen": (num_seqs,),
        }
        for name, shape in shapes.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"initial_cache: {name} has shape {list(got)}, expected {list(shape)} "
                                 f"for {num_seqs} sequences, {num_heads} heads, head dim {head_dim}")
        if self.positions.dtype != torch.int64 or self.seen.dtype != torch.int64:
            raise ValueError("initial_cache: positions and seen must be int64")
