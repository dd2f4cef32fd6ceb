"""What a resumed run may change, and how each change is applied.

A checkpoint carries the resolved config of the run that wrote it (``info.config``), its global batch and its
tokenizer's fingerprint. When a run resumes from it, every setting that differs falls in one class, which each
config field names in its :func:`hola_titan.config.setting` (``resume=``):

- **fixed** (:data:`FIXED`): they change the model's function or the document stream (flavour, size, cache
  window and block, layers, vocabulary, sequence length, seed, data source, split, text field, packing,
  hold-out, streaming), or the tokenizer (compared by fingerprint, so a moved folder is fine). The resume is
  refused with one line naming the key.
- **schedule** (:data:`SCHEDULE`): peak learning rate, AdamW's weight decay, betas and eps, warmup, decay type,
  final factor and ``training.steps``. Applied from the resume step (:func:`hola_titan.optim.apply_settings`). A
  schedule change after the warmup keeps the learning rate continuous: the remaining decay runs from the old
  schedule's factor at the resume step to ``min_lr_factor`` at the new last step
  (:class:`hola_titan.optim.Schedule`); a new peak rate scales the whole curve (that jump is what was asked for).
- **batch**: the global batch is the checkpoint's unless ``training.global_batch_size`` is set to another value:
  with another number of data-parallel ranks or another local batch, gradient accumulation makes up the
  difference, and when it cannot (the rows per micro-step do not divide the old global batch) the resume is
  refused naming ``training.global_batch_size``.
- **applied** (everything else: parallel layout, compile, checkpointing, metrics, kernels, ...): applied as given.

Every applied change is logged once at the start (``resume: ... changed``); the run's ``config.toml`` then
records the new values. Keys that only say how to launch (:data:`LAUNCH`) are not compared.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from hola_titan.checkpoint import CheckpointMismatchError
from hola_titan.config import JobConfig, ParallelDegrees, config_from_text, flat_items, resume_keys

logger = logging.getLogger(__name__)

FIXED = resume_keys("fixed")
SCHEDULE = resume_keys("schedule")
LAUNCH = resume_keys("launch")


@dataclass(frozen=True)
class ResumePlan:
    """What :func:`plan_resume` settled before a checkpoint's state is read."""

    changes: dict[str, tuple[Any, Any]]
    """``{key: (saved value, current value)}`` of the compared keys that differ: logged once the state loaded."""
    degrees: ParallelDegrees
    """The run's degrees with the global batch settled (the checkpoint's, unless set)."""


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` of the compared keys that differ (flat ``section.key`` dicts)."""
    return {key: (saved[key], value) for key, value in current.items()
            if key in saved and key not in LAUNCH and _norm(saved[key]) != _norm(value)}


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def plan_resume(saved: dict, *, path: Any, config: JobConfig, degrees: ParallelDegrees,
                 tokenizer_fingerprint: str) -> ResumePlan:
    """Before the state of the checkpoint at ``path`` is read: refuse a change of a fixed key or of the tokenizer,
    and settle the global batch. ``saved``: the checkpoint's run info. Raises ``CheckpointMismatchError``."""
    old = flat_items(config_from_text(saved["config"], source=f"the config recorded in {path}"))
    changes = changed_settings(old, flat_items(config))
    for key in FIXED:
        if key in changes:
            was, now = changes[key]
            raise CheckpointMismatchError(
                f"{key}: {was!r} in the run that wrote {path}, {now!r} now; a resumed run cannot change it (it "
                "changes the model or the documents it reads): set it back, or start a new run in another "
                "job.dump_folder")
    if saved["tokenizer"] != tokenizer_fingerprint:
        raise CheckpointMismatchError(
            f"model.tokenizer_path: {config.model.tokenizer_path!r} is another tokenizer than the one the run "
            f"that wrote {path} used (their fingerprints differ); use that tokenizer")
    degrees = _settle_global_batch(int(saved["global_batch_size"]), path=path, config=config, degrees=degrees)
    return ResumePlan(changes=changes, degrees=degrees)


def _settle_global_batch(saved: int, *, path: Any, config: JobConfig, degrees: ParallelDegrees) -> ParallelDegrees:
    current = degrees.global_batch_size
    if current == saved:
        return degrees
    local_batch_size = config.training.local_batch_size
    if config.training.global_batch_size not in (None, -1):
        logger.info("resume: training.global_batch_size changed: %d -> %d rows (set explicitly)", saved, current)
        return degrees
    micro_rows = local_batch_size * degrees.dp_replicate * degrees.dp_shard
    if saved % micro_rows:
        raise CheckpointMismatchError(
            f"training.global_batch_size: the run that wrote {path} trained with a global batch of {saved} rows; "
            f"{micro_rows} rows per micro-step here (local batch {local_batch_size} x {micro_rows // local_batch_size} "
            "data-parallel ranks) do not divide it. Set training.global_batch_size to the batch you want, or a "
            "local batch that divides it")
    degrees = dataclasses.replace(degrees, global_batch_size=saved, grad_accum_steps=saved // micro_rows)
    logger.info("resume: keeping the global batch of %d rows of the run that wrote %s: %d rows per micro-step, "
                "%d accumulation steps", saved, path, micro_rows, degrees.grad_accum_steps)
    return degrees
