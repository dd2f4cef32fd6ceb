"""The optimizer and its learning-rate schedule: built once from the config, and set again on resume.

:func:`build_optimizer` makes AdamW with two parameter groups (the parameters that decay and those that never do:
``no_weight_decay_names`` of the model, e.g. GDN's ``A_log`` and ``dt_bias``, and the HOLA cache's own parameters
when ``optimizer.decay_cache_scalars`` is off), a third for the cache's parameters when
``optimizer.cache_lr_multiplier`` is not 1, and a ``LambdaLR`` over a :class:`Schedule`. :func:`apply_settings`
sets every ``schedule`` key of the config (``hola_titan/resume.py``) on both: once at build, and again after a
checkpoint restored the values its run used. What a group is (decaying, its rate) is decided from the group's
parameters, not from its position.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hola_titan.config import LRScheduler, Optimizer
from hola_titan.fqn import strip_wrappers


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak learning rate after ``step`` optimizer steps: linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_factor) * progress
    return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """The learning-rate multiplier of each step: linear warmup, then decay to ``min_lr_factor`` at ``total_steps``
    (:func:`lr_lambda`). A callable object, not a closure: ``LambdaLR`` saves and restores it by its attributes, so
    a checkpoint carries the schedule it ran (their names are part of the checkpoint format).

    ``anchor_step`` / ``anchor_factor``: set when a resumed run changes the schedule after its warmup (more steps,
    another decay): from ``anchor_step`` on, the factor decays from ``anchor_factor`` (the old schedule's factor at
    that step) to ``min_lr_factor`` at ``total_steps`` with the chosen decay, so the learning rate continues
    without a jump.
    """

    def __init__(self, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float,
                 anchor_step: int | None = None, anchor_factor: float | None = None):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.decay_type, self.min_lr_factor = decay_type, min_lr_factor
        self.anchor_step, self.anchor_factor = anchor_step, anchor_factor

    def settings(self) -> dict:
        return dict(warmup_steps=self.warmup_steps, total_steps=self.total_steps, decay_type=self.decay_type,
                    min_lr_factor=self.min_lr_factor)

    def __call__(self, step: int) -> float:
        if self.anchor_step is None or step < self.anchor_step:
            return lr_lambda(step, **self.settings())
        if self.decay_type == "constant":
            return self.anchor_factor
        progress = min(1.0, (step - self.anchor_step) / max(1, self.total_steps - self.anchor_step))
        low, high = self.min_lr_factor, self.anchor_factor
        if self.decay_type == "linear":
            return high - (high - low) * progress
        return low + (high - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _ids_of(model: nn.Module, names: set[str]) -> set[int]:
    """``id`` of ``model``'s parameters named in ``names``."""
    # Both sides without wrapper prefixes: checkpoint and compile wrappers insert them into every name.
    names = {strip_wrappers(name) for name in names}
    return {id(param) for name, param in model.named_parameters() if strip_wrappers(name) in names}


def _cache_ids(model: nn.Module) -> set[int]:
    """``id`` of the HOLA cache's own parameters (none for models without a cache)."""
    return _ids_of(model, model.cache_parameter_names() if hasattr(model, "cache_parameter_names") else set())


def _no_decay_ids(model: nn.Module, optimizer: Optimizer) -> set[int]:
    """``id`` of the parameters that never decay."""
    ids = _ids_of(model, model.no_weight_decay_names() if hasattr(model, "no_weight_decay_names") else set())
    return ids if optimizer.decay_cache_scalars else ids | _cache_ids(model)


def build_optimizer(model: nn.Module, *, optimizer: Optimizer, lr_scheduler: LRScheduler, steps: int,
                    device_type: str) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s parameters and its schedule over ``steps`` (``training.steps``), with the config's
    settings applied (:func:`apply_settings`). ``optimizer.fused`` None: fused on CUDA."""
    no_decay = _no_decay_ids(model, optimizer)
    # The cache's parameters have a group of their own only at their own rate: the default runs keep two groups (and
    # the checkpoints of earlier runs their layout).
    own_rate = _cache_ids(model) if optimizer.cache_lr_multiplier != 1.0 else set()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if id(p) not in no_decay and id(p) not in own_rate]},
              {"params": [p for p in params if id(p) in no_decay and id(p) not in own_rate]}]
    if own_rate:
        groups.append({"params": [p for p in params if id(p) in own_rate]})
    fused = optimizer.fused if optimizer.fused is not None else device_type == "cuda"
    adamw = torch.optim.AdamW(groups, lr=optimizer.lr, fused=fused, foreach=None if fused else True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, Schedule(**_schedule_settings(lr_scheduler, steps=steps)))
    apply_settings(adamw, scheduler, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, steps=steps)
    return adamw, scheduler


def describe_cache_optimizer(args, optimizer: Optimizer) -> str:
    """How the HOLA cache's own parameters are optimised, for the run's ``paths`` record ("" without a cache)."""
    if not args.is_recurrent or args.evict == "none":
        return ""
    decay = "weight decay" if optimizer.decay_cache_scalars else "no weight decay"
    return f"; cache gammas, sink and gate: {decay}, learning rate x {optimizer.cache_lr_multiplier:g}"


def _schedule_settings(lr_scheduler: LRScheduler, *, steps: int) -> dict:
    return dict(warmup_steps=lr_scheduler.warmup_steps, total_steps=steps, decay_type=lr_scheduler.decay_type,
                min_lr_factor=lr_scheduler.min_lr_factor)


def apply_settings(adamw: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, *, model: nn.Module,
                   optimizer: Optimizer, lr_scheduler: LRScheduler, steps: int) -> str | None:
    """Set the config's peak rate, betas, eps, weight decay (on the groups of decaying parameters; 0 on the others)
    and schedule from the scheduler's current step on: at build, and after a checkpoint restored its run's values.

    A schedule that differs from the scheduler's after the warmup is anchored at the current step, so the rate
    continues without a jump (:class:`Schedule`). Returns what changed in the schedule, for the log; None when it
    is as configured.
    """
    step = scheduler.last_epoch
    schedule, wanted = scheduler.lr_lambdas[0], _schedule_settings(lr_scheduler, steps=steps)
    change = None
    if schedule.settings() != wanted:
        factor = schedule(step)
        anchor = dict(anchor_step=step, anchor_factor=factor) if step > wanted["warmup_steps"] else {}
        schedule = Schedule(**wanted, **anchor)
        scheduler.lr_lambdas = [schedule] * len(adamw.param_groups)  # LambdaLR holds one per group, all alike
        change = (f"schedule from step {step}: {', '.join(f'{k} {v}' for k, v in wanted.items())}, learning-rate "
                  f"factor {schedule(step):.4f} there (was {factor:.4f})")
    no_decay, cache = _no_decay_ids(model, optimizer), _cache_ids(model)
    base_lrs = []
    for group in adamw.param_groups:
        decays = any(id(p) not in no_decay for p in group["params"])
        own_rate = (optimizer.cache_lr_multiplier != 1.0 and bool(group["params"])
                    and all(id(p) in cache for p in group["params"]))
        peak = optimizer.lr * (optimizer.cache_lr_multiplier if own_rate else 1.0)
        base_lrs.append(peak)
        group["weight_decay"] = optimizer.weight_decay if decays else 0.0
        group["betas"], group["eps"] = tuple(optimizer.betas), optimizer.eps
        group["initial_lr"] = peak
        group["lr"] = peak * schedule(step)  # the rate of the next step, as LambdaLR sets it
    scheduler.base_lrs = base_lrs
    return change
