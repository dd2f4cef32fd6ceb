"""What the HOLA cache holds: the positions each layer's persistent cache selects over a sequence, by token kind.

For a recurrent model with a cache (HOLA or HOLA+recency) and one MQAR row, the row runs through a
:class:`~hola_titan.models.model.ModelCache` one block of ``C`` tokens at a time (a chunked prefill, exactly the
one-call result by the contract); after block ``b`` each layer's cache holds, per head, the ``W`` positions that
block ``b + 1`` reads (the scores' top-W, or the most recent for recency). Every selected position is labelled
with its MQAR kind: ``key`` and ``value`` of the context pairs, ``query`` (a query key) and ``answer`` (the value
after it), ``filler``. The result gives, per layer, the share of selected slots of each kind against that kind's
share of the tokens the cache could have held (the base rate), so a score that keeps keys and values shows as
shares far above their base rate; the plot draws, per layer and head, the selected positions against the block.
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
