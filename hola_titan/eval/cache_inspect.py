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

What the read does with them (:func:`inspect_reads`): each layer's read of a whole document is recomputed from the
arguments of its ``hola_attention`` call with the reference's pieces, and its softmax split into the mass on the
entries of earlier blocks, on the in-block tokens and on the sink, beside ``|sigmoid(gate) o_cache| / |o_state|``
(how much the cache read weighs where it joins the state read). The output rebuilt from the split is tested against
the op's own, so the split is of the read that ran.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

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


# Where the cache read's softmax mass goes, and how large the gated read is beside the state read.

def read_shares(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                gamma_q: torch.Tensor, gamma_k: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, *,
                window: int, block: int, evict: str, scale: float | None, mix: str) -> dict[str, torch.Tensor]:
    """One HOLA layer's read of one sequence (``hola_attention``'s inputs, ``[1, T, H, D]``, no initial state or
    cache), recomputed with the reference's pieces so that its softmax can be split by where the mass goes:
    ``persistent`` (the W entries of earlier blocks), ``block`` (the causal in-block tokens) and ``sink``, each
    ``[T, H]`` summing to 1; ``cache_to_state`` ``[T, H]``: ``|sigmoid(gate) o_cache| / |o_state|``, the cache
    read's weight beside the state read where the two are summed (``mix="sum"``, the layer's default mixing
    before the output norm; NaN for ``"parts"``, whose parts the layer normalises before it sums them, so the raw
    reads' ratio is not their weight there); ``o``: the op's output rebuilt from the two reads (the tests hold it
    to ``hola_attention``'s, and :func:`inspect_reads` records how far it is from the output that ran)."""
    from hola_titan.kernels.hola.reference import _top_w_merge, cache_read_probs, compute_dtype, merge_read, rms_norm
    from hola_titan.kernels.gdn.reference import gated_delta_chunked, l2norm

    if q.dim() != 4 or q.shape[0] != 1:
        raise EvalError(f"cache: read shares need one sequence [1, T, H, D], got {list(q.shape)}")
    if evict not in ("score", "recency"):
        raise EvalError(f"cache: evict {evict!r} has no cache read to split")
    cdt = compute_dtype(q.dtype)
    q, k, v = (x[0].to(cdt) for x in (q, k, v))  # [T, H, D]
    g, beta = g[0].to(cdt), beta[0].to(cdt)
    seq_len, h, d = q.shape
    device = q.device
    o_state, e, _ = gated_delta_chunked(l2norm(q)[None], l2norm(k)[None], v[None], g[None], beta[None],
                                        torch.zeros(1, h, d, d, dtype=cdt, device=device),
                                        d ** -0.5 if scale is None else scale)
    o_state, e = o_state[0], e[0]  # [T, H, D]
    nb = -(-seq_len // block)
    r_pad = nb * block

    def rows(x, fill=0.0):  # [T, H, ...] -> [1, H, R, ...], padded after the last token
        x = x.transpose(0, 1)
        pad = x.new_full((h, r_pad - seq_len, *x.shape[2:]), fill)
        return torch.cat([x, pad], dim=1)[None]

    # The reference's layout with no initial cache: W empty cache slots, then the row's positions.
    valid = (torch.arange(r_pad, device=device) < seq_len)[None]
    history = []
    if window > 0:
        if evict == "score":
            key_rows, empty = rows(e.norm(dim=-1) * beta, float("-inf")), float("-inf")  # m_t = beta_t |e_t|
        else:
            key_rows, empty = torch.where(valid, torch.arange(r_pad, device=device, dtype=cdt), -1.0), -1.0
            key_rows = key_rows[:, None].expand(1, h, r_pad)
        history = _top_w_merge(torch.cat([key_rows.new_full((1, h, window), empty), key_rows], dim=-1), window,
                               block, nb)
    no_entries = torch.zeros(1, h, window, d, dtype=cdt, device=device)
    probs, values = cache_read_probs(rows(rms_norm(q, gamma_q.to(cdt))), rows(rms_norm(k, gamma_k.to(cdt))), rows(v),
                                     valid, no_entries, no_entries,
                                     torch.zeros(1, h, window, dtype=torch.bool, device=device), sink.to(cdt),
                                     block=block, window=window, history=history)
    probs = probs[0]  # [H, nb, C, W + C + 1]
    o_cache = (probs[..., :-1] @ values[0]).view(h, r_pad, d)[:, :seq_len].transpose(0, 1)  # [T, H, D]

    def tokens(x):  # [H, nb, C] -> [T, H]
        return x.reshape(h, r_pad)[:, :seq_len].transpose(0, 1)

    gated = torch.sigmoid(gate.to(cdt))[None, :, None] * o_cache
    ratio = gated.norm(dim=-1) / o_state.norm(dim=-1).clamp_min(torch.finfo(cdt).tiny)
    return {"persistent": tokens(probs[..., :window].sum(-1)),
            "block": tokens(probs[..., window:-1].sum(-1)),
            "sink": tokens(probs[..., -1]),
            "cache_to_state": ratio if mix == "sum" else torch.full_like(ratio, float("nan")),
            "o": merge_read(o_state, gated, mix)}


@contextlib.contextmanager
def _each_read(model: HolaTitanLM, record):
    """Calls ``record(name, arguments, output)`` for every layer's ``hola_attention`` call (its arguments bound to
    the signature, defaults applied): each forward calls every layer once, in order, so the names cycle."""
    import hola_titan.models.model as model_module

    original = model_module.hola_attention
    signature = inspect.signature(original)
    names = itertools.cycle(list(model.layers))

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        record(next(names), bound.arguments, result[0])
        return result

    model_module.hola_attention = wrapped
    try:
        yield
    finally:
        model_module.hola_attention = original


SHARES = ("persistent", "block", "sink", "cache_to_state")


@torch.inference_mode()
def inspect_reads(model: HolaTitanLM, documents: list[list[int]], *, bins: int = 8) -> dict:
    """Where each layer's cache read puts its softmax mass over text ``documents`` (read_shares), per layer: the
    mean over heads and every token from the second block on (the first has no entries of earlier blocks), per
    head, and per log-spaced bin of the position; ``cache_to_state`` likewise; ``rebuilt_error``: the recomputed
    read's largest distance from the output that ran, relative to that output's largest value (on a GPU the
    backend's own scores and selection ran, in bf16: a large value says the split is not of that read)."""
    args = model.args
    if not args.is_recurrent or args.evict == "none":
        raise EvalError(f"cache: {args.flavour} has no HOLA cache to inspect (HOLA or HOLA+recency)")
    block = args.block
    short = [len(ids) for ids in documents if len(ids) <= block]
    if not documents or short:
        raise EvalError(f"cache: every document needs more than one block of {block} tokens (got {short[:4]})")
    device = next(model.parameters()).device
    longest = max(len(ids) for ids in documents)
    edges = np.unique(np.geomspace(block, longest + 1, num=bins + 1).astype(np.int64))
    per_layer: dict[str, dict[str, list[np.ndarray]]] = {name: {s: [] for s in SHARES} for name in model.layers}

    rebuilt: dict[str, list[float]] = {name: [] for name in model.layers}

    def record(name, a, output):
        shares = read_shares(a["q"], a["k"], a["v"], a["g"], a["beta"], a["gamma_q"], a["gamma_k"], a["sink"],
                             a["gate"], window=a["window"], block=a["block"], evict=a["evict"], scale=a["scale"],
                             mix=a["mix"])
        for s in SHARES:
            per_layer[name][s].append(shares[s][block:].float().cpu().numpy())  # [T - C, H]
        # How far the recomputed read is from the one that ran (a GPU backend's own scores and selection: near-ties
        # may select other entries; bf16): relative to the output's largest value.
        ran = output[0].float()
        rebuilt[name].append(float((shares["o"].float() - ran).abs().max() / ran.abs().max().clamp_min(1e-30)))

    with _each_read(model, record):
        for ids in documents:
            model.hidden_states(torch.tensor(ids, device=device)[None])
    positions = np.concatenate([np.arange(block, len(ids)) for ids in documents])
    which = np.clip(np.searchsorted(edges, positions, side="right") - 1, 0, len(edges) - 2)
    layers = {}
    for name, found in per_layer.items():
        if not found["sink"]:
            raise EvalError(f"cache: layer {name} made no cache read")
        cat = {s: np.concatenate(found[s]) for s in SHARES}  # [tokens, H]
        bins_out = []
        for i in range(len(edges) - 1):
            at = which == i
            if at.any():
                bins_out.append({"from": int(edges[i]), "to": int(edges[i + 1]) - 1, "tokens": int(at.sum()),
                                 **{s: float(cat[s][at].mean()) for s in SHARES}})
        layers[name] = {**{s: float(cat[s].mean()) for s in SHARES},
                        "per_head": {s: cat[s].mean(axis=0).tolist() for s in SHARES}, "bins": bins_out,
                        "rebuilt_error": max(rebuilt[name])}
    return {"layers": layers, "documents": [len(ids) for ids in documents], "block": block,
            "window": args.window, "evict": args.evict}


def inspect_text_cache(model: HolaTitanLM, documents: list[list[int]]) -> dict:
    """``eval cache --data``: the held entries' ages (:func:`inspect_text`; none for window 0, which holds no entries
    of earlier blocks) and where the read's mass goes (:func:`inspect_reads`, under ``reads``)."""
    if model.args.is_recurrent and model.args.evict != "none" and model.args.window == 0:
        details = {"mode": "text", "layers": {}, "positions": {}, "documents": [len(ids) for ids in documents],
                   "block": model.args.block, "window": 0, "evict": model.args.evict, "early": EARLY}
    else:
        details = inspect_text(model, documents)
    details["reads"] = inspect_reads(model, documents)
    return details
