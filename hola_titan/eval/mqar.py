"""MQAR accuracy: how many key-value pairs a model recalls (rows from ``hola_titan.data.synthetic``).

For each sequence length and number of pairs, ``num_samples`` rows of the ``eval`` split are drawn (seeded by
``(seed, seq_len, pairs, index)``, disjoint from the training and validation rows) and run in one teacher-forced
forward pass each, as in Zoology: a query is answered correctly when the argmax of the logits at the query key's
position is its value (answers are single tokens, so this is greedy decoding of the answer given the true
prefix). ``accuracy`` is the fraction of queries answered correctly; ``sequence_accuracy`` the fraction of rows
with every query right. Numbers of pairs that do not fit a length (``4 * pairs > seq_len`` with every pair asked)
are skipped and listed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from hola_titan.data.synthetic import MqarSpec, mqar_row, split_code
from hola_titan.eval.runtime import EvalError, progress
from hola_titan.models.model import HolaTitanLM


def switch_cache_off(model: HolaTitanLM) -> int:
    """Force every layer's cache gate to zero (``sigmoid(gate) = 0``, so ``o = o_state``): what recall is left
    without the cache. Changes the model in place; returns the number of layers changed (0 for GDN and
    Transformer++, which have no cache)."""
    changed = 0
    with torch.no_grad():
        for block in model.layers.values():
            gate = getattr(block.attn, "gate", None)
            if gate is not None:
                gate.fill_(float("-inf"))
                changed += 1
    return changed


@torch.inference_mode()
def mqar_accuracy(model: HolaTitanLM, spec: MqarSpec, *, seq_len: int, num_pairs: int, num_samples: int,
                  batch_size: int, seed: int) -> dict:
    """Accuracy at one (seq_len, num_pairs) point."""
    device = next(model.parameters()).device
    correct = queries = rows_right = 0
    for start in range(0, num_samples, batch_size):
        rows = [mqar_row(spec, seq_len=seq_len, num_pairs=num_pairs,
                         rng=np.random.default_rng([seed, split_code("eval"), seq_len, num_pairs, i]))
                for i in range(start, min(start + batch_size, num_samples))]
        inputs = torch.from_numpy(np.stack([r.input_ids for r in rows])).to(device)
        labels = torch.from_numpy(np.stack([r.labels for r in rows])).to(device)
        hidden = model.hidden_states(inputs)
        where = labels >= 0
        predicted = F.linear(hidden[where], model.output_weight()).argmax(dim=-1)
        hit = torch.zeros_like(labels, dtype=torch.bool)
        hit[where] = predicted == labels[where]
        correct += int(hit.sum())
        queries += int(where.sum())
        rows_right += int((hit | ~where).all(dim=1).sum())
    return {"seq_len": seq_len, "pairs": num_pairs, "queries": queries, "accuracy": correct / queries,
            "sequence_accuracy": rows_right / num_samples}


def evaluate_mqar(model: HolaTitanLM, *, pairs: list[int], seq_lens: list[int], num_samples: int,
                  vocab_size: int | None = None, power_a: float = 0.01, batch_size: int = 64, seed: int = 0,
                  show_progress: bool = False) -> dict:
    """Accuracy for every (seq_len, pairs) that fits. Returns ``{"points": [...], "skipped": [...], "summary"}``."""
    vocab_size = model.args.vocab_size if vocab_size is None else vocab_size
    if vocab_size > model.args.vocab_size:
        raise EvalError(f"--vocab {vocab_size} exceeds the model's vocabulary {model.args.vocab_size}")
    if num_samples < 1 or batch_size < 1:
        raise EvalError("--samples and --batch-size must be >= 1")
    base = MqarSpec(vocab_size=vocab_size, power_a=power_a)
    if base.num_keys < max(pairs) or vocab_size - 1 - base.num_keys < max(pairs):
        raise EvalError(f"--vocab {vocab_size} has too few ids for {max(pairs)} distinct keys and values")
    todo = [(t, n) for t in seq_lens for n in pairs if 4 * n <= t]
    skipped = [{"seq_len": t, "pairs": n} for t in seq_lens for n in pairs if 4 * n > t]
    if not todo:
        raise EvalError(f"no number of pairs fits: every row needs seq_len >= 4 x pairs (pairs {pairs}, "
                        f"lengths {seq_lens})")
    points = []
    for seq_len, num_pairs in progress(todo, enabled=show_progress, total=len(todo), desc="mqar"):
        spec = dataclasses.replace(base, min_pairs=num_pairs, max_pairs=num_pairs)
        points.append(mqar_accuracy(model, spec, seq_len=seq_len, num_pairs=num_pairs, num_samples=num_samples,
                                    batch_size=batch_size, seed=seed))
    summary = {f"pairs={p['pairs']}@{p['seq_len']}": p["accuracy"] for p in points}
    return {"points": points, "skipped": skipped, "summary": summary, "vocab_size": vocab_size, "power_a": power_a}
