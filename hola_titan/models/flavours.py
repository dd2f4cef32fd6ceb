"""The model flavours, each registered once: everything that differs between them lives in its entry and its mixer.

A flavour is the token mixer of every block (DESIGN §5): ``hola`` (Gated DeltaNet with the score-filled cache),
``hola_recency`` (the same cache filled by recency, the paper's control), ``gdn`` (no cache) and ``transformer``
(Transformer++ attention). The rest of the code asks a flavour's entry (:func:`get`) or its mixer class, never the
flavour's name:

- the entry: whether the mixer is recurrent (a packed batch runs as one stream of documents; fla's kernels, the
  #640 check and the recurrent context-parallel protocol apply), the ``evict`` argument of ``hola_attention`` for
  recurrent mixers, and heads that differ from the size's (Transformer++ uses heads of 128);
- the mixer class (``hola_titan.models.model``): one constructor ``Mixer(args, *, backend, kernels,
  overlap_backward, save_cache_output)``, one forward ``mixer(x, *, context, positions, cache)``,
  ``Mixer.stream(args, tokens, context, cache)`` (the batch as the mixer's blocks take it, and the positions
  they read), ``Mixer.Cache`` (its decoding state per layer) and its tensor-parallel plan as data
  (``TP_COLWISE``, ``TP_ROWWISE``, ``TP_PER_HEAD``), which ``hola_titan.parallelisms`` applies.

A new flavour is a :func:`register` call here, its mixer class, and its tests; docs/DESIGN.md §5 sketches one.
The mixer is named as ``module:Class`` and imported on first use, so reading the registry (the config's
choices) imports no model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Flavour:
    """One flavour's entry (see the module docstring)."""

    name: str
    mixer: str  # "module:Class" of the token mixer
    recurrent: bool
    evict: str | None = None  # hola_attention's evict ("score", "recency", "none") for recurrent mixers
    # (n_heads, head_dim) by size where they differ from the size's own (models/args.py SIZE_FIELDS).
    heads: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    description: str = ""

    def mixer_class(self) -> type:
        module, _, name = self.mixer.partition(":")
        return getattr(importlib.import_module(module), name)


FLAVOURS: dict[str, Flavour] = {}


def register(flavour: Flavour) -> Flavour:
    """Add ``flavour``; its name must be new, and a recurrent flavour must say its ``evict``."""
    if flavour.name in FLAVOURS:
        raise ValueError(f"flavour {flavour.name!r} is registered already")
    if flavour.recurrent != (flavour.evict is not None):
        raise ValueError(f"flavour {flavour.name!r}: a recurrent flavour names its evict, an attention one none")
    FLAVOURS[flavour.name] = flavour
    return flavour


def get(name: str) -> Flavour:
    """The entry of ``name``; ``ValueError`` naming ``model.flavour`` and the choices otherwise."""
    try:
        return FLAVOURS[name]
    except KeyError:
        raise ValueError(f"model.flavour: unknown flavour {name!r}; expected one of {', '.join(FLAVOURS)}") from None


_RECURRENT = "hola_titan.models.model:GatedDeltaMixer"
register(Flavour("hola", _RECURRENT, recurrent=True, evict="score",
                 description="Gated DeltaNet with the cache filled by the delta rule's surprise score"))
register(Flavour("hola_recency", _RECURRENT, recurrent=True, evict="recency",
                 description="the same cache filled with the most recent tokens (the paper's control)"))
register(Flavour("gdn", _RECURRENT, recurrent=True, evict="none", description="Gated DeltaNet, no cache"))
register(Flavour("transformer", "hola_titan.models.model:Attention", recurrent=False,
                 heads={"debug": (2, 64), "small": (4, 128), "46M": (4, 128), "340M": (8, 128), "1.3B": (16, 128),
                        "7B": (32, 128)},
                 description="Transformer++ (RoPE, SwiGLU, RMSNorm, SDPA), heads of 128"))
