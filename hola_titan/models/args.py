"""Model sizes, and the numbers of a flavour at a size (DESIGN §5).

A flavour is the token mixer of every block, registered in :mod:`hola_titan.models.flavours` (``hola``,
``hola_recency``, ``gdn``, ``transformer``). A size fixes the widths. ``model_args(flavour, size, vocab_size=...)``
is the only way the rest of the system builds a :class:`ModelArgs`, so a TOML names a flavour and a size instead
of repeating numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hola_titan.models import flavours

FLAVOURS = tuple(flavours.FLAVOURS)
SIZES = ("debug", "small", "46M", "340M", "1.3B", "7B")
# The state read's factor s in o_state = s S^T qh (recurrent flavours): fla's D^-1/2, or 1 as the paper's Eq. 1 and 3
# write it (q^T S). Before the output norm, s sets how much the state weighs against the cache read at init.
STATE_READ_SCALES = ("inv_sqrt_head_dim", "one")
# Where a HOLA layer adds its cache read to the state read, with o_norm its per-head output RMSNorm:
# before_norm o_norm(o_state + l o_cache); after_norm o_norm(o_state) + l o_cache; per_path_norm
# o_norm(o_state) + l o_norm(o_cache), one norm weight for both (the paper counts no other parameter).
CACHE_MIXES = ("before_norm", "after_norm", "per_path_norm")


@dataclass(frozen=True)
class ModelArgs:
    """Every number a model needs. Built by :func:`model_args`; fields are documented where they are used."""

    flavour: str
    size: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    mlp_hidden: int
    tie_embeddings: bool
    norm_eps: float = 1e-6
    # Recurrent flavours (hola, hola_recency, gdn).
    conv_size: int = 4
    window: int = 64
    block: int = 256
    use_gate: bool = False
    # The HOLA layer's choices the paper leaves open (docs/DESIGN.md §1). The dataclass defaults are the forms
    # every earlier run and export used: a config.json written before a field existed rebuilds that model.
    state_read_scale: str = "inv_sqrt_head_dim"
    gate_init: float = -4.0  # the cache gate's logit at init: lambda = sigmoid(gate_init)
    cache_mix: str = "before_norm"
    cache_sink: bool = True  # the null sink in the cache read's softmax (False: an ablation the paper does not run)
    # Transformer++.
    rope_theta: float = 10_000.0
    max_seq_len: int = 2048

    @property
    def evict(self) -> str:
        """The ``evict`` argument of ``hola_attention`` for this flavour (``none`` for GDN)."""
        evict = flavours.get(self.flavour).evict
        if evict is None:
            raise ValueError(f"model.flavour: {self.flavour} has no HOLA layer")
        return evict

    @property
    def state_scale(self) -> float | None:
        """The ``scale`` argument of ``hola_attention``: None (``D^-1/2``) or 1.0."""
        return None if self.state_read_scale == "inv_sqrt_head_dim" else 1.0

    def describe_layer(self) -> str:
        """The recurrent layer's open choices as they run (the run's ``paths`` record and its start-up log)."""
        read = ("s = D^-1/2 (fla's default)" if self.state_read_scale == "inv_sqrt_head_dim"
                else "s = 1 (the paper's q^T S)")
        text = f"state read o_state = s S^T q, {read}"
        if self.evict != "none":
            lam = 1.0 / (1.0 + math.exp(-self.gate_init))
            out = {"before_norm": "o_norm(o_state + l o_cache)", "after_norm": "o_norm(o_state) + l o_cache",
                   "per_path_norm": "o_norm(o_state) + l o_norm(o_cache)"}[self.cache_mix]
            text += (f"; out = {out}, l = sigmoid(gate), gate init {self.gate_init:g} "
                     f"(lambda {lam:.4g}); cache {self.evict}, window {self.window}, block {self.block}"
                     + ("" if self.cache_sink else ", no sink (model.cache_sink false)"))
        return text

    @property
    def is_recurrent(self) -> bool:
        """Whether the flavour's mixer is recurrent (its registry entry, :mod:`hola_titan.models.flavours`)."""
        return flavours.get(self.flavour).recurrent

    def mixer_class(self) -> type:
        """The flavour's token mixer class (``hola_titan.models.model``)."""
        return flavours.get(self.flavour).mixer_class()


# Widths per size, shared by every flavour (a flavour's entry may give other heads). MLP hidden sizes follow fla's
# GDN recipe (2/3 * 4 * dim rounded up to a multiple of 256), which with 4 x 256 heads gives 341.6M at 340M.
SIZE_FIELDS = {
    "debug": dict(dim=128, n_layers=2, n_heads=2, head_dim=64, mlp_hidden=512, tie_embeddings=True,
                  window=8, block=32),
    # ~30M with the bundled tokenizer: the small-scale comparisons (train_configs/small_*.toml).
    "small": dict(dim=512, n_layers=8, n_heads=2, head_dim=256, mlp_hidden=1536, tie_embeddings=True),
    # The paper's ablation size (12 layers, d_model 512, heads of 256): 45.6M with the bundled 8192-entry tokenizer.
    "46M": dict(dim=512, n_layers=12, n_heads=2, head_dim=256, mlp_hidden=1536, tie_embeddings=True),
    "340M": dict(dim=1024, n_layers=24, n_heads=4, head_dim=256, mlp_hidden=2816, tie_embeddings=True),
    "1.3B": dict(dim=2048, n_layers=24, n_heads=8, head_dim=256, mlp_hidden=5632, tie_embeddings=True),
    "7B": dict(dim=4096, n_layers=32, n_heads=16, head_dim=256, mlp_hidden=11008, tie_embeddings=False),
}


def model_args(flavour: str, size: str, *, vocab_size: int, window: int | None = None, block: int | None = None,
               n_layers: int | None = None, max_seq_len: int | None = None, state_read_scale: str | None = None,
               gate_init: float | None = None, cache_mix: str | None = None,
               cache_sink: bool | None = None) -> ModelArgs:
    """The :class:`ModelArgs` of ``flavour`` at ``size``.

    ``vocab_size`` comes from the tokenizer. ``window`` and ``block`` override the HOLA cache size and block
    length (recurrent flavours), ``n_layers`` the depth; ``max_seq_len`` is the training context recorded in exports
    (``max_position_embeddings``): RoPE angles are computed from the positions, so it bounds nothing.
    ``state_read_scale`` (:data:`STATE_READ_SCALES`), ``gate_init``, ``cache_mix`` (:data:`CACHE_MIXES`) and
    ``cache_sink`` override the HOLA layer's open choices.
    """
    entry = flavours.get(flavour)
    if size not in SIZES:
        raise ValueError(f"model.size: unknown size {size!r}; expected one of {', '.join(SIZES)}")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"model.vocab_size: must be a positive integer, got {vocab_size!r}")
    fields = dict(SIZE_FIELDS[size])
    if size in entry.heads:
        fields["n_heads"], fields["head_dim"] = entry.heads[size]
    if window is not None:
        if window < 0:
            raise ValueError(f"model.window: must be >= 0, got {window}")
        fields["window"] = window
    if block is not None:
        if block <= 0:
            raise ValueError(f"model.block: must be >= 1, got {block}")
        fields["block"] = block
    if n_layers is not None:
        if n_layers <= 0:
            raise ValueError(f"model.n_layers: must be >= 1, got {n_layers}")
        fields["n_layers"] = n_layers
    if max_seq_len is not None:
        fields["max_seq_len"] = max_seq_len
    if state_read_scale is not None:
        if state_read_scale not in STATE_READ_SCALES:
            raise ValueError(f"model.state_read_scale: expected one of {', '.join(STATE_READ_SCALES)}, got "
                             f"{state_read_scale!r}")
        fields["state_read_scale"] = state_read_scale
    if gate_init is not None:
        if not math.isfinite(gate_init):
            raise ValueError(f"model.gate_init: must be finite, got {gate_init}")
        fields["gate_init"] = float(gate_init)
    if cache_mix is not None:
        if cache_mix not in CACHE_MIXES:
            raise ValueError(f"model.cache_mix: expected one of {', '.join(CACHE_MIXES)}, got {cache_mix!r}")
        fields["cache_mix"] = cache_mix
    if cache_sink is not None:
        fields["cache_sink"] = bool(cache_sink)
    return ModelArgs(flavour=flavour, size=size, vocab_size=vocab_size, **fields)


def replace(args: ModelArgs, **changes) -> ModelArgs:
    """A copy of ``args`` with ``changes`` (for tests and tiny models); unknown fields raise ``TypeError``."""
    return dataclasses.replace(args, **changes)
