"""Perplexity on held-out text, per token, per byte and per word.

What is scored (``convention="hola_titan"``, the default). Each document is encoded as in training
(``hola_titan.data``): its tokens, then one EOS. As in ``varlen`` training, the state starts fresh at every
document and the first token of a document has no context, so the targets are tokens 2 .. n and the EOS.
``loss`` is the mean negative log-likelihood (nats) over those targets, ``perplexity = exp(loss)``,
``bits_per_token = loss / ln 2``. Byte normalisation divides the same total by the UTF-8 bytes the targets spell:
the document's bytes minus those of its first token, plus one byte for the EOS (it stands for the document
break); ``bits_per_byte`` and ``byte_perplexity = 2 ** bits_per_byte`` follow. Word normalisation divides it by
the document's words as lm-evaluation-harness's ``wikitext`` task counts them (the pieces of the text, before
tokenisation, split on runs of whitespace): ``word_perplexity = exp(total / words)``, the "Wiki. ppl" of the GDN
and HOLA papers' tables. Two models on the same text have the same words, so their ratio is the token perplexities'
ratio raised to ``tokens_per_word``: a per-word gap is larger than the per-token one by that factor in nats, which
matters when a gap is set beside a paper's (its tokenizer spells a word in fewer tokens than a small vocabulary does).

``convention="lm_eval"`` scores what lm-evaluation-harness's rolling log-likelihood (its ``wikitext``-style
tasks) scores: the document is prefixed with EOS, every one of its tokens is a target (the first predicted
from the EOS alone) and no EOS follows; bytes are the document's UTF-8 bytes. The two differ by one target at
each end (the first token, hard to predict, against the closing EOS, often easy), which matters on short
documents (tests/test_lm_eval.py checks the lm_eval convention against lm-eval itself). With a document longer
than lm-eval's ``max_length``, lm-eval scores disjoint windows while the default here gives
every target its whole document: the numbers then differ by the context each target sees.

Context. ``window=None`` (the default) gives every target its whole document as context: documents no longer
than ``chunk`` tokens are packed into rows of at most ``chunk`` tokens with ``cu_seqlens`` (so no state crosses
documents), longer documents run through the decoding cache in chunks of ``chunk`` tokens, which for HOLA and
GDN keeps memory constant and for Transformer++ holds all keys and values. ``window=W`` with ``stride=S``
(default ``S = W``: non-overlapping chunks) is the sliding window: windows of ``W`` tokens start every ``S``
tokens, each scores the targets the previous window did not, so every target after the first window sees at
least ``W - S`` tokens of context. A document of at most ``W`` targets fits one window, which is its whole
document: it is scored as in the default mode (packed with others), the same function in far fewer calls.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hola_titan.data.tokenizer import Tokenizer
from hola_titan.eval.runtime import EvalError, progress
from hola_titan.models.model import HolaTitanLM, ModelCache


@dataclass(frozen=True)
class Document:
    """One encoded document: ``ids`` (targets ``ids[1:]``), EOS at the end or, under lm-eval's convention, at the
    start; ``target_bytes`` and ``words`` as in the module docstring."""

    ids: list[int]
    target_bytes: int
    words: int


CONVENTIONS = ("hola_titan", "lm_eval")


def count_words(text: str) -> int:
    """Words of a document as lm-evaluation-harness's ``wikitext`` task counts them: the pieces of a split on runs
    of whitespace, so leading or trailing whitespace adds an empty piece, as it does there."""
    return len(_WHITESPACE.split(text))


_WHITESPACE = re.compile(r"\s+")


def encode_documents(texts: Iterable[str], tokenizer: Tokenizer, *, max_tokens: int | None = None,
                     max_documents: int | None = None, convention: str = "hola_titan") -> list[Document]:
    """Encode documents (skipping empty ones) until ``max_tokens`` tokens or ``max_documents`` documents, under
    ``convention`` (module docstring). A document that would pass ``max_tokens`` is cut to fit (its EOS then
    still ends it, or begins it)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: expected one of {CONVENTIONS}, got {convention!r}")
    documents: list[Document] = []
    total = 0
    for text in texts:
        if max_documents is not None and len(documents) >= max_documents:
            break
        ids = tokenizer.encode(text)
        if not ids:
            continue
        if max_tokens is not None and total + len(ids) + 1 > max_tokens:
            keep = max_tokens - total - 1
            if keep < 1:
                break
            ids = ids[:keep]
            text = tokenizer.decode(ids)
        words = count_words(text)
        if convention == "lm_eval":
            documents.append(Document(ids=[tokenizer.eos_id] + ids, target_bytes=len(text.encode("utf-8")),
                                      words=words))
        else:
            first_bytes = len(tokenizer.decode(ids[:1]).encode("utf-8"))
            target_bytes = max(len(text.encode("utf-8")) - first_bytes, 0) + 1
            documents.append(Document(ids=ids + [tokenizer.eos_id], target_bytes=target_bytes, words=words))
        total += len(ids) + 1
        if max_tokens is not None and total >= max_tokens:
            break
    return documents


def _token_nll(model: HolaTitanLM, inputs: torch.Tensor, targets: torch.Tensor, *,
               cu_seqlens: torch.Tensor | None = None, cache: ModelCache | None = None) -> torch.Tensor:
    """Per-target NLL (float64, ``[t]``) for one row ``inputs`` ``[1, t]``."""
    hidden = model.hidden_states(inputs, cu_seqlens=cu_seqlens, cache=cache)
    logits = F.linear(hidden[0], model.output_weight()).float()
    return F.cross_entropy(logits, targets, reduction="none").double()


def _score_packed(model: HolaTitanLM, docs: list[list[int]], device: torch.device) -> list[np.ndarray]:
    """Whole-document NLLs of short documents packed into one row with ``cu_seqlens``."""
    inputs = torch.tensor([t for d in docs for t in d[:-1]], device=device)[None]
    targets = torch.tensor([t for d in docs for t in d[1:]], device=device)
    lengths = [len(d) - 1 for d in docs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    nll = _token_nll(model, inputs, targets, cu_seqlens=cu if len(docs) > 1 else None).cpu().numpy()
    return np.split(nll, np.cumsum(lengths)[:-1])


def _score_streamed(model: HolaTitanLM, doc: list[int], device: torch.device, chunk: int) -> np.ndarray:
    """Whole-document NLL through the decoding cache, ``chunk`` tokens per call."""
    ids = torch.tensor(doc, device=device)
    cache = ModelCache()
    parts = []
    for start in range(0, len(doc) - 1, chunk):
        end = min(start + chunk, len(doc) - 1)
        parts.append(_token_nll(model, ids[None, start:end], ids[start + 1:end + 1], cache=cache).cpu().numpy())
    return np.concatenate(parts)


def _score_windows(model: HolaTitanLM, doc: list[int], device: torch.device, window: int, stride: int) -> np.ndarray:
    """Sliding-window NLL of one document (module docstring)."""
    ids = torch.tensor(doc, device=device)
    num_targets = len(doc) - 1
    nll = np.empty(num_targets, dtype=np.float64)
    scored = 0
    begin = 0
    while scored < num_targets:
        end = min(begin + window, num_targets)
        values = _token_nll(model, ids[None, begin:end], ids[begin + 1:end + 1]).cpu().numpy()
        nll[scored:end] = values[scored - begin:]
        scored = end
        begin += stride
    return nll


@torch.inference_mode()
def score_documents(model: HolaTitanLM, documents: list[Document], *, window: int | None = None,
                    stride: int | None = None, chunk: int = 2048, show_progress: bool = False) -> list[np.ndarray]:
    """Per-target NLL (nats) of every document, in order (module docstring for ``window``, ``stride``, ``chunk``)."""
    if chunk < 1:
        raise EvalError(f"--chunk must be >= 1, got {chunk}")
    if window is not None:
        stride = window if stride is None else stride
        if window < 1 or not 1 <= stride <= window:
            raise EvalError(f"--window {window} --stride {stride}: need window >= 1 and 1 <= stride <= window")
    elif stride is not None:
        raise EvalError("--stride needs --window")
    device = next(model.parameters()).device
    results: list[np.ndarray | None] = [None] * len(documents)
    pending: list[int] = []

    def flush() -> None:
        for index, values in zip(pending, _score_packed(model, [documents[i].ids for i in pending], device)):
            results[index] = values
        pending.clear()

    packed_len = 0
    for index in progress(range(len(documents)), enabled=show_progress, total=len(documents), desc="perplexity"):
        doc = documents[index].ids
        if len(doc) < 2:
            results[index] = np.zeros(0)
        elif window is not None and len(doc) - 1 > window:
            results[index] = _score_windows(model, doc, device, window, stride)
        elif len(doc) - 1 > chunk:
            results[index] = _score_streamed(model, doc, device, chunk)
        else:
            if packed_len + len(doc) - 1 > chunk:
                flush()
                packed_len = 0
            pending.append(index)
            packed_len += len(doc) - 1
    if pending:
        flush()
    return results


def summarise(documents: list[Document], nll: list[np.ndarray], *, bins: int = 12) -> dict:
    """Totals, per-token and per-byte metrics, and the mean loss per context-position bin (for the plot)."""
    tokens = int(sum(len(values) for values in nll))
    if tokens == 0:
        raise EvalError("no target tokens to score (every document is shorter than two tokens)")
    total = float(sum(values.sum() for values in nll))
    num_bytes = int(sum(doc.target_bytes for doc, values in zip(documents, nll) if len(values)))
    words = int(sum(doc.words for doc, values in zip(documents, nll) if len(values)))
    loss = total / tokens
    bits_per_byte = total / math.log(2) / num_bytes
    # Position p of a target = number of context tokens it saw (1 .. n-1); log-spaced bins for long documents.
    longest = max(len(values) for values in nll)
    edges = np.unique(np.geomspace(1, longest + 1, num=bins + 1).astype(np.int64))
    sums = np.zeros(len(edges) - 1)
    counts = np.zeros(len(edges) - 1)
    for values in nll:
        positions = np.arange(1, len(values) + 1)
        which = np.clip(np.searchsorted(edges, positions, side="right") - 1, 0, len(edges) - 2)
        np.add.at(sums, which, values)
        np.add.at(counts, which, 1)
    by_position = [{"from": int(edges[i]), "to": int(edges[i + 1]) - 1, "tokens": int(counts[i]),
                    "loss": float(sums[i] / counts[i])} for i in range(len(counts)) if counts[i]]
    return {
        "documents": len(documents), "tokens": tokens, "bytes": num_bytes, "nll_sum": total, "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2),
        "bits_per_byte": bits_per_byte, "byte_perplexity": 2.0 ** min(bits_per_byte, 1000.0),
        "words": words, "tokens_per_word": tokens / words, "word_perplexity": math.exp(min(total / words, 700.0)),
        "loss_by_position": by_position,
    }
