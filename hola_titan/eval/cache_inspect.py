"""What the HOLA cache holds: the positions each layer's persistent cache selects over a sequence, by token kind.

For a recurrent model with a cache (HOLA or HOLA+recency) and one MQAR row, the row runs through a
:class:`~hola_titan.models.model.ModelCache` one block of ``C`` tokens at a time (a chunked prefill, exactly the
one-call result by the contract); after block ``b`` each layer's cache holds, per head, the ``W`` positions that
block ``b + 1`` reads (the scores' top-W, or the most recent for recency). Every selected position is labelled
with its MQAR kind: ``key`` and ``value`` of the context pairs, ``query`` (a query key) and ``answer`` (the value
after it), ``filler``. The result gives, per layer, the share of selected slots of each kind against that kind's
share of the tokens the cache could have held (the base rate), so a score that keeps keys and values shows as
shares far above their base rate; the plot draws, per layer and head, the selected positions against the block.

On text (:func:`inspect_text`: the longest documents of a file) the question is how old the held entries are. For
block ``b`` read at position ``r = b * C``, a held position ``p`` has relative age ``(r - p) / r`` (0: just before
the block, 1: the document's first token), and it is *early* when ``p < r / 8``. A cache that kept a uniform
sample of the prefix would hold 1/8 early entries at mean relative age 1/2; recency holds none at about ``W / r``.
Both are given per layer and per bin of ``r`` (log-spaced), so a cache that fills with the first blocks' outliers
as the document grows shows as an early share rising with ``r``.
"""

from __future__ import annotations

import numpy as np
import torch

from hola_titan.data.synthetic import MqarSpec, mqar_row, split_code
from hola_titan.eval.runtime import EvalError
from hola_titan.models.model import HolaTitanLM, ModelCache

KINDS = ("key", "value", "query", "answer", "filler")


def mqar_kinds(row, seq_len: int) -> np.ndarray:
    """The kind index (into :data:`KINDS`) of every position of an MQAR row."""
    kinds = np.full(seq_len, KINDS.index("filler"), dtype=np.int64)
    n = row.num_pairs
    kinds[0:2 * n:2] = KINDS.index("key")
    kinds[1:2 * n:2] = KINDS.index("value")
    kinds[row.query_positions] = KINDS.index("query")
    kinds[row.query_positions + 1] = KINDS.index("answer")
    return kinds


@torch.inference_mode()
def cache_selections(model: HolaTitanLM, tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """``{layer: positions [num_blocks - 1, H, W]}`` (-1: an empty slot): row ``b`` is what block ``b + 1`` reads,
    for token ids ``[1, T]``."""
    args = model.args
    if not args.is_recurrent or args.evict == "none":
        raise EvalError(f"cache: {args.flavour} has no HOLA cache to inspect (HOLA or HOLA+recency)")
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise EvalError(f"cache: expected token ids [1, T], got shape {list(tokens.shape)}")
    cache = ModelCache()
    seen: dict[str, list[np.ndarray]] = {name: [] for name in model.layers}
    block = args.block
    for start in range(0, tokens.shape[1] - block, block):  # the last block's selection is read by nothing
        model.hidden_states(tokens[:, start:start + block], cache=cache)
        for name in model.layers:
            seen[name].append(cache.layers[name].hola.positions[0].cpu().numpy())
    if not seen[next(iter(seen))]:
        raise EvalError(f"cache: the row needs more than one block of {block} tokens")
    return {name: np.stack(rows) for name, rows in seen.items()}


def inspect_mqar(model: HolaTitanLM, *, seq_len: int, num_pairs: int, vocab_size: int | None = None,
                 power_a: float = 0.01, seed: int = 0) -> dict:
    """Selections of one ``eval``-split MQAR row (seeded as ``hola_titan.eval.mqar`` draws them) with kind shares.

    Returns ``{"layers": {layer: {"share": {kind: share of selected slots}, "base": {kind: share of the tokens
    before each reading block}}}, "positions": {layer: [[[...]]]}, "kinds": [...], "block", "window", ...}``."""
    vocab_size = model.args.vocab_size if vocab_size is None else vocab_size
    spec = MqarSpec(vocab_size=vocab_size, min_pairs=num_pairs, max_pairs=num_pairs, power_a=power_a)
    try:
        spec.check(seq_len=seq_len, model_vocab_size=model.args.vocab_size, where="cache")
        row = mqar_row(spec, seq_len=seq_len, num_pairs=num_pairs,
                       rng=np.random.default_rng([seed, split_code("eval"), seq_len, num_pairs, 0]))
    except ValueError as error:
        raise EvalError(str(error)) from None
    device = next(model.parameters()).device
    selections = cache_selections(model, torch.from_numpy(row.input_ids)[None].to(device))
    kinds = mqar_kinds(row, seq_len)
    block = model.args.block
    layers = {}
    for name, pos in selections.items():
        held = pos[pos >= 0]
        counts = np.bincount(kinds[held], minlength=len(KINDS)) if held.size else np.zeros(len(KINDS))
        # Base rate: the kinds of the tokens each reading block could have selected from (all earlier tokens).
        base = sum(np.bincount(kinds[:(b + 1) * block], minlength=len(KINDS)) for b in range(pos.shape[0]))
        layers[name] = {"share": {k: float(c) / max(held.size, 1) for k, c in zip(KINDS, counts)},
                        "base": {k: float(c) / max(base.sum(), 1) for k, c in zip(KINDS, base)},
                        "filled": float(held.size) / pos.size}
    return {"layers": layers, "positions": {name: pos.tolist() for name, pos in selections.items()},
            "kinds": kinds.tolist(), "block": block, "window": model.args.window, "evict": model.args.evict,
            "seq_len": seq_len, "pairs": num_pairs}


EARLY = 8
"""A held position ``p`` read at ``r`` is early when ``p < r / EARLY`` (a uniform sample of the prefix: 1 / EARLY)."""


def inspect_text(model: HolaTitanLM, documents: list[list[int]], *, bins: int = 8) -> dict:
    """Ages of the held entries over text ``documents`` (token ids; each longer than one block), per layer: overall
    and per log-spaced bin of the reading position (module docstring). ``positions`` keeps the first (longest)
    document's selections for the plot."""
    if not documents:
        raise EvalError("cache: no document to inspect")
    if model.args.window == 0:
        raise EvalError("cache: the model's window is 0: its cache holds no entries of earlier blocks to inspect")
    block = model.args.block
    short = [len(ids) for ids in documents if len(ids) <= block]
    if short:
        raise EvalError(f"cache: every document needs more than one block of {block} tokens (got {short[:4]})")
    device = next(model.parameters()).device
    per_doc = [cache_selections(model, torch.tensor(ids, device=device)[None]) for ids in documents]
    longest = max(len(ids) for ids in documents)
    edges = np.unique(np.geomspace(block, longest + 1, num=bins + 1).astype(np.int64))  # r runs from C up
    layers = {}
    for name in per_doc[0]:
        readers, ages, early = [], [], []
        for pos in (sel[name] for sel in per_doc):
            # Row b of the selections is what block b + 1 reads, at r = (b + 1) * C.
            held = pos >= 0
            r = np.broadcast_to((np.arange(pos.shape[0]) + 1)[:, None, None] * block, pos.shape)[held]
            p = pos[held]
            readers.append(r)
            ages.append((r - p) / r)
            early.append(p * EARLY < r)
        readers, ages, early = np.concatenate(readers), np.concatenate(ages), np.concatenate(early)
        which = np.clip(np.searchsorted(edges, readers, side="right") - 1, 0, len(edges) - 2)
        rows = []
        for i in range(len(edges) - 1):
            at = which == i
            if at.any():
                rows.append({"from": int(edges[i]), "to": int(edges[i + 1]) - 1, "slots": int(at.sum()),
                             "mean_relative_age": float(ages[at].mean()), "early_share": float(early[at].mean())})
        layers[name] = {"mean_relative_age": float(ages.mean()), "early_share": float(early.mean()), "bins": rows}
    return {"mode": "text", "layers": layers,
            "positions": {name: pos.tolist() for name, pos in per_doc[0].items()},
            "documents": [len(ids) for ids in documents], "block": block, "window": model.args.window,
            "evict": model.args.evict, "early": EARLY}
