"""What a resumed run may change, and how each change is applied.

A checkpoint carries the resolved config of the run that wrote it (``info.config``), its global batch and its
tokenizer's fingerprint. When a run resumes from it, every setting that differs falls in one class, which each
config field names in its :func:`hola_titan.config.setting` (``resume=``):

- **fixed** (:data:`FIXED`): they change the model's function or the document stream (flavour, size, cache
  window and block, layers, vocabulary, sequence length, seed, data source, split, text field, packing,
  hold-out, streaming), or the tokenizer (compared by fingerprint, so a moved folder is fine). The resume is
  refused with one line naming the key.
- **schedule** (:data:`SCHEDULE`): peak learning rate, AdamW's weight decay, betas and eps, warmup, decay type,
  final factor and ``training.steps``. Applied from the resume step. A schedule change after the warmup keeps the
  learning rate continuous: the remaining decay runs from the old schedule's factor at the resume step to
  ``min_lr_factor`` at the new last step (:class:`hola_titan.train.Schedule`); a new peak rate scales the whole
  curve (that jump is what was asked for).
- **batch**: the global batch is the checkpoint's unless ``training.global_batch_size`` is set to another value:
  with another number of data-parallel ranks or another local batch, gradient accumulation makes up the
  difference, and when it cannot (the rows per micro-step do not divide the old global batch) the resume is
  refused naming ``training.global_batch_size``.
- **applied** (everything else: parallel layout, compile, checkpointing, metrics, kernels, ...): applied as given.

Every applied change is logged once at the start (``resume: ... changed``); the run's ``config.toml`` then
records the new values. Keys that only say how to launch (:data:`LAUNCH`) are not compared.
"""

from __future__ import annotations

from typing import Any

from hola_titan.config import resume_keys

FIXED = resume_keys("fixed")
SCHEDULE = resume_keys("schedule")
LAUNCH = resume_keys("launch")


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` of the compared keys that differ (flat ``section.key`` dicts)."""
    return {key: (saved[key], value) for key, value in current.items()
            if key in saved and key not in LAUNCH and _norm(saved[key]) != _norm(value)}


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
