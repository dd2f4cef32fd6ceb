"""Evaluation: perplexity, constant-memory generation, RULER-style needles and MQAR (``python -m hola_titan.eval``).

Modules:

* :mod:`~hola_titan.eval.cli`: the command line (one command per eval, ``--compare`` across checkpoints);
* :mod:`~hola_titan.eval.loading`: exported folders (``hola_titan.export``) or ``init:<flavour>`` models;
* :mod:`~hola_titan.eval.perplexity`: per-token and per-byte perplexity, full-context or sliding window;
* :mod:`~hola_titan.eval.generation`: chunked prefill, greedy / sampled decoding through the model's cache,
  decoding memory at several context lengths;
* :mod:`~hola_titan.eval.niah`: needle-in-a-haystack prompts of exact token length, and their scoring;
* :mod:`~hola_titan.eval.mqar`: MQAR accuracy (rows from :mod:`hola_titan.data.synthetic`);
* :mod:`~hola_titan.eval.cache_inspect`: which positions each layer's HOLA cache selects, by MQAR token kind;
* :mod:`~hola_titan.eval.report`: result JSON, plots and comparison tables;
* :mod:`~hola_titan.eval.runtime`: errors, lengths like ``4k``, devices and peak memory.

docs/evaluation.md shows one command per eval and how to run lm-eval on an exported folder.
"""

from hola_titan.eval.generation import Generation, SamplingOptions, generate, measure_decoding_memory
from hola_titan.eval.loading import LoadedModel, load_model, wrap_model
from hola_titan.eval.runtime import EvalError

__all__ = [
    "EvalError",
    "Generation",
    "LoadedModel",
    "SamplingOptions",
    "generate",
    "load_model",
    "measure_decoding_memory",
    "wrap_model",
]
