"""Parameter names: the model's own fully qualified names, without the prefixes that wrappers insert.

Activation checkpointing (``_checkpoint_wrapped_module.``), ``torch.compile`` (``_orig_mod.``) and FSDP1
(``_fsdp_wrapped_module.``) wrap modules and change the names their parameters are listed under; checkpoints,
exports, the optimizer's weight-decay groups and the layout-independent init all use the names without them.
"""

from __future__ import annotations

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def strip_wrappers(name: str) -> str:
    """``name`` without wrapper prefixes, e.g. ``layers.0._orig_mod.attn.q_proj.weight`` ->
    ``layers.0.attn.q_proj.weight``."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
