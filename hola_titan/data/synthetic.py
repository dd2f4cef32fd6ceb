"""Synthetic token-level data: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology").

A ``dataset`` string ``"mqar:<key>=<value>,..."`` selects it in :func:`hola_titan.data.build_dataloader` and
:func:`~hola_titan.data.build_validation_dataloader`; the rows are token ids, not text, so the tokenizer only
bounds the vocabulary. Keys (all optional)::

    vocab=8192      ids used, at most the model's vocabulary: 0 is the filler, keys are 1 .. K, values K+1 .. vocab-1
                    with K = (vocab - 1) // 2
    pairs=16        key-value pairs per row; "4-64" draws the number uniformly per row from 4 .. 64; a list
                    "4/8/16/32/64" draws one of its numbers per row, equally often, and "4:5/8:1/16:1" with those
                    weights (Zoology's MQAR trains on such a mix: 100,000 rows of 4 pairs beside 20,000 each of 8,
                    16, 32 and 64, so that the easy rows teach the recall that the hard ones then need)
    queries=N       keys queried per row (default: all pairs; at most the row's pairs)
    power_a=0.01    query placement: slot s (0 = right after the pairs) has probability ~ (s + 1)^(power_a - 1)

Row layout (``T = seq_len``, ``N`` pairs, ``Q`` queries)::

    k_1 v_1 k_2 v_2 ... k_N v_N | 0 0 k_i v_i 0 0 0 0 k_j v_j 0 ...
    '----- 2N context tokens ---' '-- (T - 2N) // 2 two-token slots, Q of them hold a query --'

Keys are distinct within a row and so are values. A query slot holds a key of the context and then its value
(teacher forcing); the target at the query key's position is that value (``labels[p] = input_ids[p + 1]``), and
every other label is ``-100``, so the loss counts the answers only. Every row is one sequence (no
``cu_seqlens``); ``data.varlen`` has no effect.

Row ``j`` of a split is drawn from ``numpy.random.default_rng([seed, split_code, j])``: rows do not depend on the
batch size, the data-parallel layout or resumption, and the ``train``, ``validation`` and ``eval`` splits are
disjoint streams. The loader has the ``state_dict`` / ``load_state_dict`` protocol of the packed loader.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hola_titan.data.packing import IGNORE_INDEX, Batch, RowLoader

MQAR_PREFIX = "mqar:"
FILLER_ID = 0
_STATE_VERSION = 1
_SPLIT_CODES = {"train": 0, "validation": 1, "eval": 2}
_DEFAULT_VALIDATION_BATCHES = 8


def is_synthetic(dataset: str) -> bool:
    """Whether ``dataset`` names a synthetic source (``mqar:...``) rather than text."""
    return dataset == MQAR_PREFIX[:-1] or dataset.startswith(MQAR_PREFIX)


@dataclass(frozen=True)
class MqarSpec:
    """An MQAR task (module docstring): vocabulary, pairs per row (a range), queries per row, query placement."""

    vocab_size: int = 8192
    min_pairs: int = 16
    max_pairs: int = 16
    num_queries: int | None = None
    """None: every pair is queried."""
    power_a: float = 0.01
    pair_mix: tuple[tuple[int, float], ...] = ()
    """``(pairs, weight)`` choices drawn per row in proportion to the weights; empty: uniform over the range."""

    @property
    def num_keys(self) -> int:
        """Size of the key id range ``1 .. K``; values use the ``vocab_size - 1 - K`` ids above it."""
        return (self.vocab_size - 1) // 2

    def queries_for(self, num_pairs: int) -> int:
        return num_pairs if self.num_queries is None else min(self.num_queries, num_pairs)

    def min_seq_len(self) -> int:
        """The shortest row that holds ``max_pairs`` pairs and their queries."""
        return 2 * self.max_pairs + 2 * self.queries_for(self.max_pairs)

    def check(self, *, seq_len: int, model_vocab_size: int | None = None, where: str = "mqar") -> None:
        """Raise ``ValueError`` (starting with ``where``) when rows of ``seq_len`` cannot hold the task."""
        if seq_len < self.min_seq_len():
            raise ValueError(f"{where}: seq_len {seq_len} is too short for {self.max_pairs} pairs and "
                             f"{self.queries_for(self.max_pairs)} queries (needs >= {self.min_seq_len()})")
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ValueError(f"{where}: vocab {self.vocab_size} exceeds the model's vocabulary {model_vocab_size}")

    def draw_pairs(self, rng: np.random.Generator) -> int:
        """The pairs of one row: from :attr:`pair_mix` by weight, else uniformly over the range."""
        if self.pair_mix:
            weights = np.array([w for _, w in self.pair_mix], dtype=np.float64)
            return self.pair_mix[int(rng.choice(len(self.pair_mix), p=weights / weights.sum()))][0]
        return int(rng.integers(self.min_pairs, self.max_pairs + 1))

    def describe(self) -> str:
        pairs = str(self.min_pairs) if self.min_pairs == self.max_pairs else f"{self.min_pairs}-{self.max_pairs}"
        if self.pair_mix:  # exact weights: the text is what a resumed run's data is checked against
            pairs = "/".join(f"{n}:{int(w) if w.is_integer() else repr(w)}" for n, w in self.pair_mix)
        text = f"{MQAR_PREFIX}vocab={self.vocab_size},pairs={pairs},power_a={self.power_a:g}"
        return text if self.num_queries is None else text + f",queries={self.num_queries}"


def parse_mqar(dataset: str) -> MqarSpec:
    """The :class:`MqarSpec` of ``"mqar:vocab=...,pairs=...,..."``; raises ``ValueError`` naming a bad key."""
    if not is_synthetic(dataset):
        raise ValueError(f"dataset {dataset!r} is not an MQAR source (expected 'mqar:key=value,...')")
    values: dict[str, Any] = {}
    body = dataset[len(MQAR_PREFIX):] if dataset.startswith(MQAR_PREFIX) else ""
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not raw:
            raise ValueError(f"dataset {dataset!r}: expected key=value, got {item!r}")
        try:
            if key == "vocab":
                values["vocab_size"] = int(raw)
            elif key == "pairs" and ("/" in raw or ":" in raw):
                mix = []
                for choice in raw.split("/"):
                    n, colon, w = choice.partition(":")
                    mix.append((int(n), float(w) if colon else 1.0))
                if any(n < 1 for n, _ in mix) or any(not 0 < w < math.inf for _, w in mix) or \
                        len({n for n, _ in mix}) < len(mix):
                    raise ValueError(f"dataset {dataset!r}: pairs={raw!r}: each choice needs pairs >= 1, a finite "
                                     "weight > 0 and a number of pairs of its own")
                values["pair_mix"] = tuple(sorted(mix))
                values["min_pairs"], values["max_pairs"] = min(n for n, _ in mix), max(n for n, _ in mix)
            elif key == "pairs":
                low, _, high = raw.partition("-")
                values["min_pairs"], values["max_pairs"] = int(low), int(high or low)
            elif key == "queries":
                values["num_queries"] = int(raw)
            elif key == "power_a":
                values["power_a"] = float(raw)
            else:
                raise ValueError(f"dataset {dataset!r}: unknown MQAR key {key!r} (keys: vocab, pairs, queries, "
                                 "power_a)")
        except ValueError as error:
            if "unknown MQAR key" in str(error) or "each choice needs" in str(error):
                raise
            raise ValueError(f"dataset {dataset!r}: {key}={raw!r} is not a number") from None
    spec = MqarSpec(**values)
    if not 1 <= spec.min_pairs <= spec.max_pairs:
        raise ValueError(f"dataset {dataset!r}: pairs must be >= 1 (a range low-high with low <= high)")
    if spec.num_queries is not None and spec.num_queries < 1:
        raise ValueError(f"dataset {dataset!r}: queries must be >= 1")
    if not 0 < spec.power_a <= 1:
        raise ValueError(f"dataset {dataset!r}: power_a must be in (0, 1]")
    if spec.num_keys < spec.max_pairs or spec.vocab_size - 1 - spec.num_keys < spec.max_pairs:
        raise ValueError(f"dataset {dataset!r}: vocab {spec.vocab_size} has too few ids for {spec.max_pairs} "
                         "distinct keys and values")
    return spec


@dataclass(frozen=True)
class MqarRow:
    """One MQAR sequence and where its answers are."""

    input_ids: np.ndarray
    """int64 ``[T]``."""
    labels: np.ndarray
    """int64 ``[T]``: the value at each query key's position, ``-100`` elsewhere."""
    keys: np.ndarray
    """``[N]`` the context keys in order (key ``i`` at position ``2i``, its value at ``2i + 1``)."""
    values: np.ndarray
    """``[N]``."""
    query_positions: np.ndarray
    """``[Q]`` positions of the query keys, increasing; the answer is ``labels[p]`` (and ``input_ids[p + 1]``)."""

    @property
    def num_pairs(self) -> int:
        return len(self.keys)


def mqar_row(spec: MqarSpec, *, seq_len: int, rng: np.random.Generator, num_pairs: int | None = None) -> MqarRow:
    """Draw one row (module docstring). ``num_pairs`` None draws it from the spec's range."""
    if num_pairs is None:
        num_pairs = spec.draw_pairs(rng)
    num_queries = spec.queries_for(num_pairs)
    slots = (seq_len - 2 * num_pairs) // 2
    if slots < num_queries:
        raise ValueError(f"mqar: seq_len {seq_len} cannot hold {num_pairs} pairs and {num_queries} queries")
    keys = 1 + rng.choice(spec.num_keys, size=num_pairs, replace=False)
    values = 1 + spec.num_keys + rng.choice(spec.vocab_size - 1 - spec.num_keys, size=num_pairs, replace=False)
    input_ids = np.full(seq_len, FILLER_ID, dtype=np.int64)
    input_ids[0:2 * num_pairs:2] = keys
    input_ids[1:2 * num_pairs:2] = values
    weights = np.arange(1, slots + 1, dtype=np.float64) ** (spec.power_a - 1.0)
    chosen = np.sort(rng.choice(slots, size=num_queries, replace=False, p=weights / weights.sum()))
    asked = rng.permutation(num_pairs)[:num_queries]
    positions = 2 * num_pairs + 2 * chosen
    input_ids[positions] = keys[asked]
    input_ids[positions + 1] = values[asked]
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    labels[positions] = values[asked]
    return MqarRow(input_ids=input_ids, labels=labels, keys=keys, values=values, query_positions=positions)


def split_code(split: str) -> int:
    """The integer that separates the random streams of ``split`` (known names fixed, others hashed)."""
    return _SPLIT_CODES.get(split, 1000 + zlib.crc32(split.encode()))


def row_rng(seed: int, split: str, row: int) -> np.random.Generator:
    """The generator of global row ``row`` of ``split``."""
    return np.random.default_rng([seed, split_code(split), row])


class MqarLoader(RowLoader):
    """Yields :class:`~hola_titan.data.packing.Batch` dicts of MQAR rows for one data-parallel rank.

    Sharding and state follow the packed loader: global batch ``i`` is rows ``[i*W*b, (i+1)*W*b)`` in rank order,
    and the state counts global rows consumed. ``num_batches`` None: endless (training); an int: the same first
    ``num_batches`` batches every iteration (validation).
    """

    def __init__(self, spec: MqarSpec, *, seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int,
                 seed: int, split: str, num_batches: int | None = None) -> None:
        self.spec = spec
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.split = split
        self.num_batches = num_batches
        self.shuffle = False
        self.global_rows_consumed = 0

    def rows(self, first: int, count: int) -> list[MqarRow]:
        """Global rows ``first .. first + count - 1``."""
        return [mqar_row(self.spec, seq_len=self.seq_len, rng=row_rng(self.seed, self.split, j))
                for j in range(first, first + count)]

    def _batch_at(self, first_global_row: int) -> Batch:
        rows = self.rows(first_global_row + self.dp_rank * self.local_batch_size, self.local_batch_size)
        input_ids = torch.from_numpy(np.stack([r.input_ids for r in rows]))
        labels = torch.from_numpy(np.stack([r.labels for r in rows]))
        positions = torch.arange(self.seq_len, dtype=torch.int64).expand(len(rows), -1).clone()
        return Batch(input_ids=input_ids, labels=labels, position_ids=positions)

    def __iter__(self) -> Iterator[Batch]:
        if self.num_batches is not None:
            for index in range(self.num_batches):
                yield self._batch_at(index * self.global_batch_rows)
            return
        while True:
            batch = self._batch_at(self.global_rows_consumed)
            self.global_rows_consumed += self.global_batch_rows
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "global_rows_consumed": self.global_rows_consumed,
                "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle, "dataset": self.spec.describe()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after the rows a saved state had consumed (any data-parallel degree or batch size)."""
        if "global_rows_consumed" not in state_dict:
            raise ValueError(f"not a data loader state (keys: {sorted(state_dict)})")
        for key, mine in (("seq_len", self.seq_len), ("seed", self.seed), ("dataset", self.spec.describe())):
            if state_dict.get(key) != mine:
                raise ValueError(f"data loader state was saved with {key}={state_dict.get(key)!r}, this loader has "
                                 f"{key}={mine!r}")
        self.global_rows_consumed = int(state_dict["global_rows_consumed"])


def build_synthetic_dataloader(dataset: str, *, vocab_size: int, seq_len: int, local_batch_size: int, dp_rank: int,
                               dp_world_size: int, seed: int, split: str, num_batches: int | None = None,
                               validation: bool = False) -> MqarLoader:
    """The loader of a synthetic ``dataset`` (``build_dataloader`` and ``build_validation_dataloader`` call this).

    ``vocab_size`` is the tokenizer's (the model's) vocabulary; validation loaders default to
    8 batches when ``num_batches`` is None.
    """
    spec = parse_mqar(dataset)
    spec.check(seq_len=seq_len, model_vocab_size=vocab_size, where=f"dataset {dataset!r}")
    if validation and num_batches is None:
        num_batches = _DEFAULT_VALIDATION_BATCHES
    return MqarLoader(spec, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                      dp_world_size=dp_world_size, seed=seed, split=split, num_batches=num_batches)
