"""One way from a config to a model: tokenizer -> model arguments -> model.

The trainer, ``--dry-run``, the seed checkpoint (``python -m hola_titan.seed``) and checkpoint conversion
(``scripts/convert_to_safetensors.py``) all take this path, so they agree on the vocabulary, the sizes and the
initial weights.
"""

from __future__ import annotations

from typing import Any

from hola_titan.config import ConfigError, JobConfig
from hola_titan.models.args import ModelArgs, model_args


def build_model_args(config: JobConfig, vocab_size: int) -> ModelArgs:
    """The :class:`ModelArgs` of ``config`` for a vocabulary of ``vocab_size``."""
    model = config.model
    return model_args(model.flavour, model.size, vocab_size=vocab_size, window=model.window, block=model.block,
                      n_layers=model.n_layers, max_seq_len=config.training.seq_len,
                      state_read_scale=model.state_read_scale, gate_init=model.gate_init, cache_mix=model.cache_mix,
                      cache_sink=model.cache_sink)


def model_args_of(config: JobConfig, *, tokenizer_optional: bool = False) -> tuple[ModelArgs, Any]:
    """``(ModelArgs, tokenizer)`` of ``config``: the vocabulary is the tokenizer's, checked against
    ``model.vocab_size`` when that is set. With ``tokenizer_optional`` (a dry run) a tokenizer that is not on disk
    is replaced by ``model.vocab_size`` (the tokenizer is then None).

    Raises:
        ConfigError: ``model.vocab_size`` differs from the tokenizer's, or is needed and not set.
        FileNotFoundError: the tokenizer is not on disk (and not optional).
    """
    from hola_titan.data import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.model.tokenizer_path)
    except FileNotFoundError as err:
        if not tokenizer_optional:
            raise
        if config.model.vocab_size is None:
            raise ConfigError("model.vocab_size", f"needed for a dry run without the tokenizer ({err})") from None
        return build_model_args(config, config.model.vocab_size), None
    if config.model.vocab_size is not None and config.model.vocab_size != tokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} differs from the {tokenizer.vocab_size} "
                          f"entries of the tokenizer {config.model.tokenizer_path!r}; remove the key or fix it")
    return build_model_args(config, tokenizer.vocab_size), tokenizer
