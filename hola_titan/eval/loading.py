"""The model to evaluate: an exported folder, or a freshly initialised model (smoke tests, memory measurements).

``spec`` forms:

* a folder written by ``hola_titan.export.save_pretrained`` (``config.json``, safetensors weights, tokenizer
  files), loaded with ``hola_titan.export.load_pretrained``;
* ``init:<flavour>[:<size>]`` (e.g. ``init:hola``, ``init:gdn:340M``): a model of that flavour and size (default
  ``debug``) with the bundled tokenizer, initialised from ``seed``. Its outputs mean nothing; it exercises the
  code paths and measures memory and speed without a checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hola_titan.data.tokenizer import Tokenizer, load_tokenizer
from hola_titan.eval.runtime import EvalError
from hola_titan.models.args import FLAVOURS, SIZES, model_args
from hola_titan.models.model import HolaTitanLM, build_model, num_params

INIT_PREFIX = "init:"


@dataclass
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, and the names reports use."""

    model: HolaTitanLM
    tokenizer: Tokenizer
    spec: str
    """What it was loaded from (the ``--checkpoint`` value)."""
    label: str
    """Short name for tables and file names."""

    def describe(self) -> dict:
        """The model facts every result file records."""
        args = self.model.args
        facts = {"flavour": args.flavour, "size": args.size, "params": num_params(self.model),
                 "vocab_size": args.vocab_size, "dim": args.dim, "n_layers": args.n_layers,
                 "max_seq_len": args.max_seq_len}
        if args.is_recurrent:
            facts.update(window=args.window, block=args.block, evict=args.evict)
        return facts


def label_of(spec: str) -> str:
    """A file-name-safe label: the folder name, or ``init-<flavour>[-<size>]``."""
    if spec.startswith(INIT_PREFIX):
        raw = "init-" + spec[len(INIT_PREFIX):].replace(":", "-")
    else:
        path = Path(spec)
        raw = path.name or path.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw) or "model"


def _load_init(spec: str, *, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[HolaTitanLM, Tokenizer]:
    parts = spec[len(INIT_PREFIX):].split(":")
    flavour, size = parts[0], parts[1] if len(parts) > 1 else "debug"
    if len(parts) > 2 or flavour not in FLAVOURS or size not in SIZES:
        raise EvalError(f"checkpoint {spec!r}: expected init:<flavour>[:<size>] with flavour one of "
                        f"{', '.join(FLAVOURS)} and size one of {', '.join(SIZES)}")
    tokenizer = load_tokenizer("bundled")
    torch.manual_seed(seed)
    model = build_model(model_args(flavour, size, vocab_size=tokenizer.vocab_size), device="cpu")
    return model.to(device=device, dtype=dtype), tokenizer


def _load_export(spec: str, *, device: torch.device, dtype: torch.dtype) -> tuple[HolaTitanLM, Tokenizer]:
    path = Path(spec).expanduser()
    if not path.exists():
        raise EvalError(f"checkpoint {spec!r} does not exist (expected a folder written by "
                        "hola_titan.export.save_pretrained, or init:<flavour>)")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise EvalError(f"checkpoint {spec!r} is not an exported model folder (no config.json in it)")
    try:
        from hola_titan.export import load_pretrained
    except ImportError as error:
        raise EvalError(f"checkpoint {spec!r}: loading exported folders needs hola_titan.export ({error})") from None
    try:
        model, tokenizer = load_pretrained(path, device=device, dtype=dtype)
    except (OSError, ValueError, KeyError) as error:
        raise EvalError(f"checkpoint {spec!r} cannot be loaded: {error}") from None
    if tokenizer is None:
        # A folder exported without tokenizer files: the bundled tokenizer fits when the vocabulary does.
        tokenizer = load_tokenizer("bundled")
        if tokenizer.vocab_size != model.args.vocab_size:
            raise EvalError(f"checkpoint {spec!r} has no tokenizer.json and its vocabulary ({model.args.vocab_size}) "
                            f"is not the bundled tokenizer's ({tokenizer.vocab_size})")
    return model, tokenizer


def load_model(spec: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """Load ``spec`` (module docstring) in eval mode. Raises :class:`EvalError` with a one-line message."""
    if spec.startswith(INIT_PREFIX):
        model, tokenizer = _load_init(spec, device=device, dtype=dtype, seed=seed)
    else:
        model, tokenizer = _load_export(spec, device=device, dtype=dtype)
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, spec=spec, label=label_of(spec))


def wrap_model(model: HolaTitanLM, tokenizer: Tokenizer, *, label: str = "model") -> LoadedModel:
    """A model built in-process (tests, notebooks) in the form the evaluations take."""
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, spec=label, label=label_of(label))
