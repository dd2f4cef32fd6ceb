"""RULER-style needle-in-a-haystack tasks, generated locally and deterministically from a seed.

Tasks (after RULER's ``niah_*`` set, hola-paper.md section 5):

========== ========================== ======= ====================================================
task       haystack                   value   needles
========== ========================== ======= ====================================================
s_niah_1   repeated noise sentences   number  1 key, 1 value
s_niah_2   natural text (corpus)      number  1 key, 1 value
s_niah_3   natural text (corpus)      UUID    1 key, 1 value
mk_niah    natural text (corpus)      number  4 keys with a value each; 1 key is asked
mv_niah    natural text (corpus)      number  1 key with 4 values; all 4 are asked
mq_niah    natural text (corpus)      number  4 keys with a value each; all 4 are asked
========== ========================== ======= ====================================================

A prompt is ``prefix + context + question``: the prefix announces the hidden values, the context is the haystack
with needle sentences ("One of the special magic numbers for <key> is: <value>.") inserted at sentence
boundaries, and the question ends with an answer lead-in ("... The special magic number for <key> mentioned in
the provided text is") that the model continues greedily. Keys are adjective-noun pairs, numbers have 7 digits,
UUIDs are version 4.

Length and depth. The prompt is exactly ``length`` tokens: the context is built from whole words, each encoded
with its leading space, so token counts add up, and the haystack is the run of words (from a seeded start in the
word stream, shifted a word at a time until the count comes out exact) that fills what the prefix, needles and
question leave. For the bundled (byte-level BPE) tokenizer, re-encoding ``text`` gives ``input_ids`` exactly.
The first needle (the asked one for ``mk_niah``) goes to the sentence boundary nearest to ``depth`` percent of
the haystack tokens (a word boundary when no sentence ends within 64 tokens); the others go to seeded random
depths. ``needles[i]["start"]`` / ``["end"]`` are token positions in ``input_ids``.

Scoring. The continuation is cut at its first newline (or EOS). A sample is correct (``exact``) when every
expected value occurs in it (case-insensitive); ``recall`` is the fraction that occur (RULER's
``string_match_all``). Accuracy per length and depth is the mean of ``exact``.

Samples are seeded by ``(seed, task, length, depth, index)``, so adding lengths or depths keeps the others.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from hola_titan.data.sources import read_documents, resolve_source
from hola_titan.data.tokenizer import BUNDLED, Tokenizer
from hola_titan.eval.generation import generate
from hola_titan.eval.runtime import EvalError, format_length, progress
from hola_titan.models.model import HolaTitanLM

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SNAP_TOKENS = 64
"""A needle moves at most this far from its requested depth to reach a sentence boundary."""

_ADJECTIVES = ("amber", "brave", "calm", "clever", "crimson", "curious", "dusty", "eager", "faint", "fancy", "gentle",
               "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "misty", "noble", "odd", "pale",
               "proud", "quick", "quiet", "rapid", "rusty", "sharp", "shiny", "silent", "silver", "sleepy", "smooth",
               "sunny", "swift", "tall", "tender", "velvet", "wild", "witty")
_NOUNS = ("anchor", "badger", "banjo", "beacon", "canyon", "carpet", "castle", "comet", "donkey", "engine", "falcon",
          "fiddle", "garden", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "lantern", "meadow",
          "mirror", "needle", "orchard", "otter", "pebble", "pepper", "pillow", "puzzle", "rocket", "saddle",
          "shovel", "spider", "teapot", "thunder", "tractor", "trumpet", "tunnel", "violin", "walnut")


@dataclass(frozen=True)
class NiahTask:
    """One task of the table in the module docstring."""

    name: str
    haystack: str
    """``noise`` or ``essay`` (natural text)."""
    value_kind: str
    """``number`` or ``uuid``."""
    num_keys: int = 1
    values_per_key: int = 1
    asks_all_keys: bool = False

    @property
    def num_needles(self) -> int:
        return self.num_keys * self.values_per_key

    @property
    def code(self) -> int:
        """A stable number of the task for seeding."""
        return list(TASKS).index(self.name)


TASKS: dict[str, NiahTask] = {task.name: task for task in (
    NiahTask("s_niah_1", "noise", "number"),
    NiahTask("s_niah_2", "essay", "number"),
    NiahTask("s_niah_3", "essay", "uuid"),
    NiahTask("mk_niah", "essay", "number", num_keys=4),
    NiahTask("mv_niah", "essay", "number", values_per_key=4),
    NiahTask("mq_niah", "essay", "number", num_keys=4, asks_all_keys=True),
)}


@dataclass
class NiahSample:
    """One prompt and where its needles are (module docstring)."""

    task: str
    length: int
    depth: float
    """Requested depth of the first needle, percent."""
    input_ids: list[int]
    text: str
    answers: list[str]
    """The values the continuation must contain."""
    query: list[str]
    """The asked keys."""
    needles: list[dict] = field(default_factory=list)
    """Per needle: ``key``, ``value``, ``start``, ``end`` (token span in ``input_ids``), ``depth`` (actual, %)."""
    max_new_tokens: int = 16


# ---------------------------------------------------------------------------------------------------------------
# Haystacks and word encoding
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def haystack_words(haystack: str, source: str = BUNDLED) -> tuple[str, ...]:
    """The word stream of a haystack: the noise sentences, or every document of ``source`` (split ``train``),
    whitespace-normalised, in stored order. Streams are read cyclically."""
    if haystack == "noise":
        return tuple(NOISE_TEXT.split())
    try:
        documents = read_documents(resolve_source(source, split="train"))
        words = tuple(word for doc in documents for word in doc.split())
    except (OSError, ValueError) as error:
        raise EvalError(f"--haystack {source!r}: {error}") from None
    if len(words) < 1000:
        raise EvalError(f"--haystack {source!r}: only {len(words)} words; need at least 1000")
    return words


class WordEncoder:
    """Token ids of ``" " + word``, cached; concatenating them encodes the joined words (byte-level BPE)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}

    def prime(self, words) -> None:
        missing = list(dict.fromkeys(w for w in words if w not in self._ids))
        for word, ids in zip(missing, self.tokenizer.encode_batch([" " + w for w in missing])):
            self._ids[word] = tuple(ids)

    def ids(self, word: str) -> tuple[int, ...]:
        if word not in self._ids:
            self.prime([word])
        return self._ids[word]


@functools.lru_cache(maxsize=8)
def _stop_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """EOS and every token whose text holds a newline: the answer ends there."""
    newline = {i for i in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([i])}
    return frozenset(newline | {tokenizer.eos_id})


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


def _kind(task: NiahTask, plural: bool) -> str:
    noun = "number" if task.value_kind == "number" else "UUID"
    return noun + "s" if plural else noun


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def prompt_parts(task: NiahTask, query: list[str]) -> tuple[str, str]:
    """``(prefix, question)``; the prefix ends with a newline and the question starts with one."""
    plural = _kind(task, True)
    prefix = (f"Some special magic {plural} are hidden within the following text. Make sure to memorize it. "
              f"I will quiz you about the {plural} afterwards.\n")
    many = task.values_per_key > 1 or len(query) > 1
    kind = _kind(task, many)
    keys = _join_keys(query)
    if many:
        question = (f"\nWhat are all the special magic {kind} for {keys} mentioned in the provided text? "
                    f"The special magic {kind} for {keys} mentioned in the provided text are")
    else:
        question = (f"\nWhat is the special magic {kind} for {keys} mentioned in the provided text? "
                    f"The special magic {kind} for {keys} mentioned in the provided text is")
    return prefix, question


def needle_text(task: NiahTask, key: str, value: str) -> str:
    return f"One of the special magic {_kind(task, True)} for {key} is: {value}."


def _draw_value(task: NiahTask, rng: np.random.Generator) -> str:
    if task.value_kind == "number":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def _draw_keys(count: int, rng: np.random.Generator) -> list[str]:
    picks = rng.choice(len(_ADJECTIVES) * len(_NOUNS), size=count, replace=False)
    return [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in picks]


def _exact_run(words: tuple[str, ...], encoder: WordEncoder, start: int, budget: int,
               tries: int = 512) -> tuple[list[str], list[int]]:
    """Consecutive words (cyclic, from ``start`` or a little after) whose ids add up to exactly ``budget`` tokens;
    returns the words and their token counts."""
    for shift in range(tries):
        chosen: list[str] = []
        counts: list[int] = []
        total = 0
        index = start + shift
        while total < budget:
            word = words[index % len(words)]
            if len(chosen) % 4096 == 0:
                encoder.prime(words[(index + k) % len(words)] for k in range(4096))
            n = len(encoder.ids(word))
            chosen.append(word)
            counts.append(n)
            total += n
            index += 1
        if total == budget:
            return chosen, counts
    raise EvalError(f"could not fill a haystack of exactly {budget} tokens from the word stream")


def _boundary(offsets: np.ndarray, sentence_end: np.ndarray, target: float) -> int:
    """Index of the word boundary for a needle: the nearest sentence boundary within ``SNAP_TOKENS`` tokens of
    ``target``, else the nearest word boundary. ``offsets[i]`` is the token offset of boundary ``i``."""
    nearest = int(np.argmin(np.abs(offsets - target)))
    candidates = np.flatnonzero(sentence_end)
    if len(candidates):
        best = int(candidates[np.argmin(np.abs(offsets[candidates] - target))])
        if abs(offsets[best] - target) <= SNAP_TOKENS:
            return best
    return nearest


def make_sample(task: NiahTask, *, length: int, depth: float, tokenizer: Tokenizer, encoder: WordEncoder,
                words: tuple[str, ...], rng: np.random.Generator) -> NiahSample:
    """One prompt of exactly ``length`` tokens with the first needle at ``depth`` percent (module docstring)."""
    keys = _draw_keys(task.num_keys, rng)
    pairs = [(key, _draw_value(task, rng)) for key in keys for _ in range(task.values_per_key)]
    query = keys if task.asks_all_keys else keys[:1]
    answers = [value for key, value in pairs if key in query]
    prefix, question = prompt_parts(task, query)
    prefix_ids, question_ids = tokenizer.encode(prefix), tokenizer.encode(question)
    needle_words = [needle_text(task, key, value).split() for key, value in pairs]
    needle_ids = [[t for w in ws for t in encoder.ids(w)] for ws in needle_words]
    budget = length - len(prefix_ids) - len(question_ids) - sum(len(ids) for ids in needle_ids)
    if budget < 1:
        raise EvalError(f"length {length} is too short for {task.name}: the prompt without haystack takes "
                        f"{length - budget} tokens")
    hay, counts = _exact_run(words, encoder, int(rng.integers(len(words))), budget)

    # Boundary i is before word i (i = len(hay): the end); sentence boundaries follow a word ending a sentence.
    offsets = np.concatenate([[0], np.cumsum(counts)])
    sentence_end = np.array([True] + [w.endswith((".", "!", "?")) for w in hay])
    depths = [depth] + [float(rng.uniform(0, 100)) for _ in range(len(pairs) - 1)]
    slots = [_boundary(offsets, sentence_end, d / 100 * budget) for d in depths]
    # Needles at the same boundary keep their order; build the context word list and the token spans together.
    order = sorted(range(len(pairs)), key=lambda j: (slots[j], j))
    context: list[str] = []
    needles: list[dict] = [{} for _ in pairs]
    position = len(prefix_ids)
    word = 0
    for j in order:
        context.extend(hay[word:slots[j]])
        position += int(offsets[slots[j]] - offsets[word])
        word = slots[j]
        key, value = pairs[j]
        needles[j] = {"key": key, "value": value, "start": position, "end": position + len(needle_ids[j]),
                      "depth": 100.0 * float(offsets[slots[j]]) / budget}
        context.extend(needle_words[j])
        position += len(needle_ids[j])
    context.extend(hay[word:])
    input_ids = prefix_ids + [t for w in context for t in encoder.ids(w)] + question_ids
    if len(input_ids) != length:  # the construction guarantees it; a failure is a bug here
        raise AssertionError(f"built {len(input_ids)} tokens for length {length}")
    text = prefix + "".join(" " + w for w in context) + question
    answer_tokens = len(tokenizer.encode(" " + ", ".join(answers)))
    return NiahSample(task=task.name, length=length, depth=depth, input_ids=input_ids, text=text, answers=answers,
                      query=query, needles=needles, max_new_tokens=answer_tokens + 8)


def sample_rng(seed: int, task: NiahTask, length: int, depth: float, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, task.code, length, int(round(depth * 100)), index])


def build_samples(task_name: str, *, length: int, depths: list[float], samples_per_depth: int, seed: int,
                  tokenizer: Tokenizer, haystack_source: str = BUNDLED,
                  encoder: WordEncoder | None = None) -> list[NiahSample]:
    """Every sample of one task at one length: ``samples_per_depth`` per depth, depth-major."""
    if task_name not in TASKS:
        raise EvalError(f"unknown NIAH task {task_name!r}; expected one of {', '.join(TASKS)}")
    task = TASKS[task_name]
    words = haystack_words(task.haystack, haystack_source)
    encoder = encoder or WordEncoder(tokenizer)
    return [make_sample(task, length=length, depth=depth, tokenizer=tokenizer, encoder=encoder, words=words,
                        rng=sample_rng(seed, task, length, depth, i))
            for depth in depths for i in range(samples_per_depth)]


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def score(prediction: str, answers: list[str]) -> tuple[bool, float]:
    """``(exact, recall)`` of a continuation (module docstring)."""
    text = prediction.split("\n", 1)[0].lower()
    found = sum(answer.lower() in text for answer in answers)
    return found == len(answers), found / len(answers)


def run_samples(model: HolaTitanLM, tokenizer: Tokenizer, samples: list[NiahSample], *, batch_size: int,
                prefill_chunk: int, show_progress: bool = False, desc: str = "niah",
                decode: str = "eager") -> list[dict]:
    """Greedy answers to ``samples`` (all of one length, so they batch without padding); one record each.
    ``decode``: how the steps run (:func:`hola_titan.eval.generation.generate`)."""
    device = next(model.parameters()).device
    stops = _stop_ids(tokenizer)
    records = []
    batches = range(0, len(samples), batch_size)
    for start in progress(batches, enabled=show_progress, total=len(batches), desc=desc):
        group = samples[start:start + batch_size]
        prompt = torch.tensor([s.input_ids for s in group], device=device)
        result = generate(model, prompt, max_new_tokens=max(s.max_new_tokens for s in group),
                          prefill_chunk=prefill_chunk, stop_ids=stops, decode=decode)
        for sample, tokens in zip(group, result.tokens):
            prediction = tokenizer.decode(tokens)
            exact, recall = score(prediction, sample.answers)
            records.append({"depth": sample.depth, "length": sample.length, "exact": exact, "recall": recall,
                            "answers": sample.answers, "prediction": prediction.split("\n", 1)[0],
                            "needle_depths": [round(n["depth"], 2) for n in sample.needles]})
    return records


def evaluate_niah(model: HolaTitanLM, tokenizer: Tokenizer, *, tasks: list[str], lengths: list[int],
                  depths: list[float], samples_per_depth: int, seed: int = 0, batch_size: int = 1,
                  prefill_chunk: int = 2048, haystack_source: str = BUNDLED, show_progress: bool = False,
                  decode: str = "eager") -> dict:
    """Accuracy per task, length and depth. Returns ``{"tasks": {task: {...}}, "summary": {...}}``; ``decode`` as
    :func:`hola_titan.eval.generation.generate` takes it."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise EvalError(f"unknown NIAH task {unknown[0]!r}; expected one of {', '.join(TASKS)}")
    encoder = WordEncoder(tokenizer)
    out: dict = {}
    summary: dict[str, float] = {}
    for name in tasks:
        records: list[dict] = []
        for length in lengths:
            samples = build_samples(name, length=length, depths=depths, samples_per_depth=samples_per_depth,
                                    seed=seed, tokenizer=tokenizer, haystack_source=haystack_source,
                                    encoder=encoder)
            records += run_samples(model, tokenizer, samples, batch_size=batch_size, prefill_chunk=prefill_chunk,
                                   show_progress=show_progress, desc=f"{name} {format_length(length)}",
                                   decode=decode)
        by_length = {}
        grid = {}
        for length in lengths:
            at_length = [r for r in records if r["length"] == length]
            by_length[format_length(length)] = float(np.mean([r["exact"] for r in at_length]))
            for depth in depths:
                cell = [r["exact"] for r in at_length if r["depth"] == depth]
                grid.setdefault(f"{depth:g}", {})[format_length(length)] = float(np.mean(cell))
        out[name] = {"accuracy_by_length": by_length, "accuracy_by_depth_length": grid,
                     "recall": float(np.mean([r["recall"] for r in records])),
                     "accuracy": float(np.mean([r["exact"] for r in records])), "samples": records}
        summary.update({f"{name}@{length}": acc for length, acc in by_length.items()})
    return {"tasks": out, "summary": summary}
