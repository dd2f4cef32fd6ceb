"""The training entry point: ``python -m hola_titan.train --job.config_file FILE [--section.key value ...]``.

One process or many (``torchrun``; gloo on CPU, NCCL on GPU). The step:

1. read ``grad_accum_steps`` micro-batches of this rank (data-parallel ranks read different rows of one global
   stream; context- and tensor-parallel ranks of a group read the same rows);
2. count the valid targets of the whole global batch (all-reduced), so the loss is the mean over every valid
   target of the global batch at any layout and any accumulation, exactly as one process would compute it;
3. forward and backward every micro-batch, scaled so that FSDP's gradient averaging gives that mean;
4. clip the global gradient norm, step AdamW and the schedule; a non-finite loss or norm skips the update.

Nothing in a step waits for the GPU (batches go up through pinned memory, the loss, the target count, the gradient
norm and the finite check stay on the device, and the fused AdamW skips a non-finite step on the device through
its ``found_inf`` input), so the host queues step N+1 while the GPU still runs step N. A step's numbers reach the
host when the loop needs them (a log, checkpoint or validation step, the end) or, at the latest, just before the
next step's optimizer update, which is when a non-finite step stops the run (``training.skip_nan_inf`` off)
with nothing written for it. With a non-fused optimizer (the CPU default) the check reads the device at once,
which costs nothing on a CPU.

Weights are initialised once from ``training.seed`` on the CPU, identically at every layout, then moved to
the device and sharded.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from hola_titan.builder import model_args_of
from hola_titan.checkpoint import HEALTHY, UNHEALTHY, UNJUDGED, CheckpointError, Checkpointer
from hola_titan.data.packing import IGNORE_INDEX
from hola_titan.data.sources import DataError
from hola_titan.config import (ConfigError, JobConfig, check_compile_fullgraph, check_memory, check_run_folders,
                               overlap_backward, parse_config, resolve_degrees, run_folders, schedule_warning, to_toml,
                               triton_cache_read_settings, validate, write_resolved)
from hola_titan.flops import flops_per_token, measured_matmul_tflops, mfu_peak
from hola_titan.kernels.runtime.documents import Documents, to_device
from hola_titan.kernels.gdn.fla_bridge import prepare_backward
from hola_titan.loss import chunked_linear_cross_entropy
from hola_titan.memory import batch_line, describe, estimate_memory
from hola_titan.metrics import MetricsLogger, peak_memory_gib, setup_logging
from hola_titan.models.context import BatchContext
from hola_titan.models.model import HolaTitanLM, build_model, num_params
from hola_titan.optim import apply_settings, build_optimizer, describe_cache_optimizer
from hola_titan.parallelisms.context_parallel import context_parallel_for
from hola_titan.parallelisms.parallel_dims import ParallelDims, end_process_group, mesh_rank_and_size, submesh
from hola_titan.parallelisms.init import init_like_one_process
from hola_titan.parallelisms.parallelize import parallelize_model
from hola_titan.profiling import step_profiler
from hola_titan.resume import plan_resume
from hola_titan.staging import describe_write_error, write_text_atomic
from hola_titan.runfolder import RunFolderError, RunFolderLock, watch_parent

logger = logging.getLogger("hola_titan")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN or inf and ``training.skip_nan_inf`` is off."""


@dataclass
class TrainState:
    """Counters that a checkpoint restores along with the model, optimizer, schedule and data position."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    # The loss-spike guard's running mean and the accepted steps it has seen (training.loss_spike_factor).
    loss_ema: float = 0.0
    loss_ema_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                "loss_ema": self.loss_ema, "loss_ema_steps": self.loss_ema_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.loss_ema = float(state.get("loss_ema", 0.0))
        self.loss_ema_steps = int(state.get("loss_ema_steps", 0))


class PendingStep:
    """The numbers of one queued step, on the device until :meth:`result` reads them (once, through a pinned
    buffer and an event recorded after the step's work, so reading waits for that step and not for the work
    queued after it)."""

    def __init__(self, *, step: int, tokens_before: int, lr: float, loss_sum: torch.Tensor,
                 targets: torch.Tensor | float, grad_norm: torch.Tensor, finite: torch.Tensor, spike: torch.Tensor,
                 loss_ema: torch.Tensor, watched: bool = False):
        self.step, self.tokens_before, self.lr = step, tokens_before, lr
        self.watched = watched  # one of the first steps after a resume (Trainer._watch_steps)
        # A target count known on the host stays there (sending it would be a copy from pageable memory).
        self._targets = None if isinstance(targets, torch.Tensor) else float(targets)
        parts = [loss_sum.double().reshape(()), grad_norm.double().reshape(()), finite.double().reshape(()),
                 spike.double().reshape(()), loss_ema.double().reshape(())]
        if self._targets is None:
            parts.append(targets.double().reshape(()))
        values = torch.stack(parts)
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(len(parts), dtype=torch.float64, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values
        self._result: dict | None = None

    def result(self) -> dict:
        """``{"loss", "grad_norm", "lr", "global_targets", "finite", "spike", "loss_ema", "ok"}`` of the step
        (waits for it once); ``ok``: the step updated the weights."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            loss_sum, grad_norm, finite, spike, loss_ema, *device_targets = self._host.tolist()
            targets = max(device_targets[0] if self._targets is None else self._targets, 1.0)
            self._result = {"loss": loss_sum / targets, "grad_norm": grad_norm, "lr": self.lr,
                            "global_targets": targets, "finite": bool(finite), "spike": bool(spike),
                            "loss_ema": loss_ema, "ok": bool(finite) and not bool(spike)}
        return self._result


def fast_path_check(chosen: str, why: str, *, device_type: str, backend: str, require: bool) -> str | None:
    """The warning for an ``auto`` attention backend that fell back to the reference on a GPU (None when it did
    not); raises :class:`ConfigError` instead with ``model.require_fast_path``."""
    if device_type != "cuda" or chosen != "reference" or backend != "auto":
        return None
    if require:
        raise ConfigError("model.require_fast_path", f"the Triton kernels cannot run here ({why})")
    return (f"attention backend: auto falls back to the PyTorch reference on this GPU ({why}); it is far slower "
            "than the Triton kernels. Set model.require_fast_path = true to refuse such a start")


def share_autotuned(kernels: dict, *, distributed: bool, group=None, gather=None) -> dict:
    """Every rank's autotuned entries (``tuned_configs.tuned_entries``) merged in rank order, on every rank, and
    served by each rank's autotuners ahead of its own choices (``tuned_configs.adopt``): a key several ranks tuned
    takes the lowest rank's configuration, so a job runs one set of launch configurations, and a key only some
    ranks launch (context-parallel ranks continue from a state that rank 0 never receives) is kept too.
    ``group``: the process group to gather over (the trainer's gloo control group: host objects, no device sync).
    ``gather`` (tests) stands in for ``torch.distributed.all_gather_object``: this rank's value in, every rank's out."""
    if not distributed:
        return kernels
    if gather is None:
        def gather(value):
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, value, group=group)
            return out
    from hola_titan.kernels.runtime import tuned_configs

    merged = tuned_configs.merge([k for k in gather(kernels) if k])
    if merged:
        tuned_configs.adopt(merged)
    return merged


def node_cache_folder(config: JobConfig) -> Path | None:
    """``job.cache_folder`` expanded, or None when it is empty (keep nothing between processes)."""
    return Path(config.job.cache_folder).expanduser() if config.job.cache_folder else None


def token_cache_folder(config: JobConfig) -> Path | None:
    """Where the loaders keep tokenised data for the node's next process (``data.token_cache``), or None."""
    folder = node_cache_folder(config)
    return folder / "tokens" if folder is not None and config.data.token_cache else None


def data_hash_folder(config: JobConfig) -> Path | None:
    """Where the loaders keep the content hashes of the data files for the node's next process (the data's
    fingerprint: :mod:`hola_titan.data.fingerprint`), or None."""
    folder = node_cache_folder(config)
    return folder / "data_hashes" if folder is not None else None


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("training.device", "cuda requested but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class Trainer:
    """Owns the model, optimizer, schedule, data and counters of one run (see the module docstring)."""

    def __init__(self, config: JobConfig):
        from hola_titan.data import build_dataloader

        self.config = config
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        validate(config, world_size=self.world_size)
        self.degrees = resolve_degrees(config.parallelism, config.training, world_size=self.world_size)
        self.device = resolve_device(config.training.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Before the run folder is made and anything allocated: a model or batch the rank cannot hold stops here.
        self.model_args, self.tokenizer = model_args_of(config)
        self._check_memory()
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.dims = ParallelDims(dp_replicate=self.degrees.dp_replicate, dp_shard=self.degrees.dp_shard,
                                 cp=self.degrees.cp, tp=self.degrees.tp, world_size=self.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        # Host-side agreement between ranks (stop signals) without touching the GPU stream.
        self._control_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self.dump = Path(config.job.dump_folder)
        if self.rank == 0:
            logger.info("starting a %s %s run in %s on %d process(es): building the model and reading the data",
                        config.model.flavour, config.model.size, self.dump, self.world_size)
        # One writer per run folder: rank 0 writes it (config, metrics, checkpoint renames) and holds its lock.
        self._folder_locks: list[RunFolderLock] = []
        check_run_folders(config)  # every rank, before anything is made
        self._check_checkpoint_folder()
        self._lock_folders()
        if config.training.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

        from hola_titan.ops import resolve_kernels
        try:
            self.kernels = resolve_kernels(config.model.kernels, self.device)
        except ValueError as err:
            raise ConfigError("model.kernels", str(err).removeprefix("kernels: ")) from None
        # The run's kernels start compiling (worker threads) as soon as the configurations file is known, before
        # fla is imported and the backend resolved: on a fresh node their compiles are most of the first step, and
        # the slowest of them (this project's cache kernels) need no fla. Joined before the first launch; stopped
        # if the backend turns out to be the reference.
        located = self._locate_kernel_configs()
        self.precompile = self._start_precompile(located)
        from hola_titan.kernels.runtime.precompile import stopped_on_error
        with stopped_on_error(self.precompile, "the run's start"):
            self.attention_backend, self._backend_why = self._resolve_attention_backend()
            if self.model_args.is_recurrent:
                # validate() refused what it could foresee; an auto backend that fell back to the reference on a GPU
                # (no fla-core) is known only now.
                check_compile_fullgraph(config, backend=self.attention_backend,
                                        where=f"{self.device.type} ({self._backend_why})")
            for key, _ in triton_cache_read_settings(config.model):
                if self.attention_backend != "triton":
                    raise ConfigError(key, f"needs the Triton attention backend; this run uses "
                                           f"{self.attention_backend} ({self._backend_why})")
            from hola_titan.kernels.dispatch import triton_importable
            if triton_importable():  # every run sets it: one run's choice must not carry over to the next
                from hola_titan.kernels.hola.triton_kernels import set_cache_kernels
                set_cache_kernels(config.model.cache_kernels)  # before the paths lines that report the choice
            if self.attention_backend == "reference":
                self.precompile.stop(f"the attention backend is the reference ({self._backend_why})")
            self.kernel_configs = self._install_kernel_configs(located)
            self.precompile.imports_done()  # fla imported (on this thread): the workers may compile its kernels too
            # Built on the meta device, parallelised, materialised with to_empty (each rank holds only its shards, on
            # its device), then initialised with the values one process draws from the seed
            # (hola_titan/parallelisms/init.py): the same initial weights at every layout, and never the whole model on
            # a rank's host or GPU.
            with torch.device("meta"):
                build = dict(backend=self.attention_backend, kernels=self.kernels,
                             overlap_backward=overlap_backward(config.model),
                             save_cache_output=config.model.save_cache_output)
                model = HolaTitanLM(self.model_args, **build)
                template = HolaTitanLM(self.model_args, **build)
            self.num_params = num_params(model)
            self._join_precompile()
        if self.device.type == "cuda" and self.model_args.is_recurrent and self.attention_backend != "reference":
            # fla's #640 gradient check runs real kernels under autograd: now, not while compile traces a block
            # or inside an activation-checkpointed forward.
            # With the run's heads per rank, compute dtype and row layout: the check compiles the step's own kernels.
            prepare_backward(self.model_args.head_dim, self.device, num_heads=self.model_args.n_heads // self.dims.tp,
                             dtype=self._compute_dtype(), packed=config.data.varlen,
                             cache_folder=config.job.cache_folder or None)
        self.model = parallelize_model(
            model, dims=self.dims, mesh=self.mesh, device=self.device, ac_mode=config.activation_checkpoint.mode,
            selective_ac_option=config.activation_checkpoint.selective_ac_option,
            compile_enable=config.compile.enable, compile_fullgraph=config.compile.fullgraph,
            float8_enable=config.float8.enable, param_dtype=config.training.mixed_precision_param,
            reduce_dtype=config.training.mixed_precision_reduce, cpu_offload=config.parallelism.fsdp_cpu_offload,
            float8_recipe=config.float8.recipe, float8_filter=tuple(config.float8.filter_fqns))
        # FSDP's CPU offload keeps the sharded parameters in host memory.
        self.model.to_empty(device="cpu" if config.parallelism.fsdp_cpu_offload else self.device)
        torch.manual_seed(config.training.seed)
        init_like_one_process(self.model, template)
        del template
        self.model.check_finite()
        # Context parallel: every rank of a cp group reads the same rows and keeps its shard of each batch; each
        # shard's view goes to the model with the batch (loss_sum).
        self.cp = context_parallel_for(self.model_args, self.mesh.named["cp"]) if self.dims.cp > 1 else None
        # Without FSDP (one GPU, or tensor parallelism alone) a GPU run gets bf16 compute from autocast; FSDP's
        # mixed-precision policy does it otherwise.
        self.autocast = (self.device.type == "cuda" and not (self.dims.fsdp_enabled or self.dims.hsdp_enabled)
                         and config.training.mixed_precision_param == "bfloat16")
        # The head's matmuls take bf16 operands when training computes in bf16 on the GPU (float32 accumulation;
        # fp32 matmuls would run at a fraction of the tensor-core rate), float32 otherwise.
        self.head_matmul_dtype = (torch.bfloat16 if self.device.type == "cuda"
                                  and config.training.mixed_precision_param == "bfloat16" else torch.float32)
        # The cross-entropy kernel works on the head's low-precision logits.
        self.loss_kernel = self.kernels == "triton" and self.head_matmul_dtype != torch.float32
        self.optimizer, self.lr_scheduler = build_optimizer(
            self.model, optimizer=config.optimizer, lr_scheduler=config.lr_scheduler, steps=config.training.steps,
            device_type=self.device.type)
        # A fused AdamW skips a non-finite step on the device (found_inf); otherwise the step reads the check.
        self._fused_optimizer = bool(self.optimizer.defaults.get("fused"))
        self._pending: PendingStep | None = None
        self._consecutive_skips = 0
        self._watch_steps = 0  # steps left that are held to the checkpoint's running loss mean (after a resume)
        # The step of the checkpoint whose weights no loss has judged yet (the newest one saved or resumed from): the
        # next step's loss, the first computed from those weights, judges it (_judge).
        self._unjudged: int | None = None
        self._resume_changes: dict = {}
        self.dp_rank, self.dp_size = mesh_rank_and_size(self.mesh, "dp")
        self.dataloader = build_dataloader(data=config.data, tokenizer=self.tokenizer, seq_len=config.training.seq_len,
                                           local_batch_size=config.training.local_batch_size, dp_rank=self.dp_rank,
                                           dp_world_size=self.dp_size, seed=config.training.seed,
                                           token_cache=token_cache_folder(config),
                                           hash_cache=data_hash_folder(config))
        self.state = TrainState()
        self._restore_guard_state()
        self.flops = flops_per_token(self.model_args, config.training.seq_len)
        self.measured_tflops = measured_matmul_tflops(self.device)
        self.peak_tflops, self._peak_source = mfu_peak(self.device, self.measured_tflops)
        # Opened by train() once the run's start is settled (a refused resume must leave the folder as it was).
        self.metrics: MetricsLogger | None = None
        self.paths = self._resolved_paths()
        self.checkpointer = None
        # What train() loads before step 1: the checkpointer (checkpoint.enable: resume, or initial_load_path when
        # the folder has no checkpoint yet), or one that only loads initial_load_path (checkpoint.enable governs
        # saving and resuming; a load path that is given is always loaded).
        self._loader = None
        ckpt = config.checkpoint
        if ckpt.enable or ckpt.initial_load_path:
            self._loader = Checkpointer(
                folder=self.dump / ckpt.folder, model=self.model, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, train_state=self.state,
                interval=ckpt.interval, keep_latest_k=ckpt.keep_latest_k,
                async_mode=ckpt.async_mode if ckpt.enable else "disabled",
                initial_load_path=ckpt.initial_load_path, load_step=ckpt.load_step, run_info=self.run_info(),
                check_resume=self.check_resume, allow_unverified=ckpt.allow_unverified)
            if ckpt.enable:
                self.checkpointer = self._loader
        # Called with the trainer after the backward pass of every step, before clipping (parity tests read the
        # gradients there).
        self.gradient_probe = None
        self._validation = None  # the validation loader, built and checked by train() before the first step

    # ------------------------------------------------------------------ resuming (hola_titan/resume.py)

    def _lock_folders(self) -> None:
        """Rank 0 takes the run folder's lock and, with checkpointing on, the checkpoint folder's own
        (``<checkpoint folder>/.lock``), wherever it is: a run whose ``checkpoint.folder`` leads (relatively, through
        a link, or absolutely) into another live run's checkpoint folder is refused, naming the holder."""
        if self.rank != 0:
            return
        for key, folder in run_folders(self.config):
            try:
                self._folder_locks.append(RunFolderLock(folder, key=key).acquire())
            except RunFolderError as err:
                for lock in self._folder_locks:
                    lock.release()
                self._folder_locks = []
                raise ConfigError(key, str(err)) from None

    def _check_checkpoint_folder(self) -> None:
        """A resume names the checkpoint folder its run wrote: when the folder's record (``config.toml``) says the
        checkpoints went to another folder that still holds some, the start is refused naming both, unless
        ``checkpoint.allow_folder_change`` (otherwise the run would start at step 0 beside them)."""
        from hola_titan.checkpoint import list_checkpoints
        from hola_titan.config import load_toml

        config = self.config
        record = self.dump / "config.toml"
        if not config.checkpoint.enable or not record.is_file():
            return
        try:
            recorded = load_toml(record).checkpoint.folder
        except (ConfigError, OSError, ValueError):
            return  # a record that does not read is no evidence of another folder; whoever reads it says why
        old, new = self.dump / recorded, self.dump / config.checkpoint.folder
        if old.resolve() == new.resolve() or not list_checkpoints(old):
            return
        if config.checkpoint.allow_folder_change:
            if self.rank == 0:
                logger.warning("checkpoint.folder: %s now, %s in the run recorded in %s (which holds checkpoints): "
                               "changed as checkpoint.allow_folder_change allows", new, old, record)
            return
        raise ConfigError("checkpoint.folder", f"{new} is not the folder this run wrote its checkpoints to: "
                          f"{record} records {old}, which holds checkpoints; set checkpoint.folder back to "
                          f"{recorded!r}, or set checkpoint.allow_folder_change = true to use {new}")

    def run_info(self) -> dict:
        """What every checkpoint records of the run that wrote it, for :meth:`check_resume`."""
        return {"config": to_toml(self.config), "global_batch_size": self.degrees.global_batch_size,
                "tokenizer": self.tokenizer.fingerprint}

    def check_resume(self, saved: dict, path) -> None:
        """Before a checkpoint's state is read: the rules of ``hola_titan/resume.py`` refuse what a resume cannot
        change and settle the global batch; the changes are kept for :meth:`_apply_resume_changes`."""
        plan = plan_resume(saved, path=path, config=self.config, degrees=self.degrees,
                           tokenizer_fingerprint=self.tokenizer.fingerprint)
        if plan.degrees.global_batch_size != self.degrees.global_batch_size and self.checkpointer is not None:
            self.checkpointer.run_info["global_batch_size"] = plan.degrees.global_batch_size
        self.degrees, self._resume_changes = plan.degrees, plan.changes

    def _apply_resume_changes(self) -> None:
        """After the checkpoint loaded: log every change and set the config's optimizer and schedule settings
        over the restored ones (``hola_titan/optim.py``)."""
        changes, self._resume_changes = self._resume_changes, {}
        for key, (was, now) in changes.items():
            logger.info("resume: %s changed: %r -> %r", key, was, now)
        config = self.config
        schedule_change = apply_settings(self.optimizer, self.lr_scheduler, model=self.model,
                                         optimizer=config.optimizer, lr_scheduler=config.lr_scheduler,
                                         steps=config.training.steps)
        if schedule_change:
            logger.info("resume: %s", schedule_change)

    def _check_memory(self) -> None:
        """:func:`~hola_titan.config.check_memory` against this rank's device and its share of the host's memory
        (the node's processes share it), before any weight or batch is allocated: a size typed with a few zeros
        too many used to grow a worker until the host killed it."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_what = f"this host's {host / 2**30:,.0f} GiB of memory shared by {local} process(es)"
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            device_bytes, device_what = props.total_memory, f"this GPU ({props.name})"
        else:
            device_bytes, device_what = host // local, host_what
        check_memory(self.config, self.model_args, self.degrees, device_bytes=device_bytes, device_what=device_what,
                     host_bytes=host // local, host_what=host_what)

    def _resolve_attention_backend(self) -> tuple[str, str]:
        """The token mixer's backend, decided once for this model and device (``hola_titan.ops.explain_backend``);
        an ``auto`` that falls back to the reference on a GPU warns, or refuses with ``model.require_fast_path``."""
        from hola_titan.ops import explain_backend

        config = self.config
        if not self.model_args.is_recurrent:
            return config.model.attention_backend, "Transformer++ uses SDPA"
        dtype = torch.bfloat16 if config.training.mixed_precision_param == "bfloat16" else torch.float32
        try:
            chosen, why = explain_backend(config.model.attention_backend, self.device,
                                          head_dim=self.model_args.head_dim, dtype=dtype)
        except ValueError as err:
            raise ConfigError("model.attention_backend", str(err).removeprefix("backend: ")) from None
        warning = fast_path_check(chosen, why, device_type=self.device.type, backend=config.model.attention_backend,
                                  require=config.model.require_fast_path)
        if warning and self.rank == 0:
            logger.warning("%s", warning)
        return chosen, why

    def _locate_kernel_configs(self):
        """The configurations file ``model.kernel_configs`` names for this run (read, nothing installed yet)."""
        from hola_titan.kernels.runtime.tuned_configs import Installed, locate

        uses_fla = (self.device.type == "cuda" and self.model_args.is_recurrent
                    and self.config.model.attention_backend != "reference")
        if not uses_fla:
            return Installed("off", None, "no fla kernels in this run")
        try:
            return locate(self.config.model.kernel_configs, self.device, node_cache=node_cache_folder(self.config),
                          job_cache=self.dump, plan_key=self._plan_key())
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError("model.kernel_configs", str(err).removeprefix("model.kernel_configs: ")) from None

    def _keep_autotuned(self) -> None:
        """After the first step: what fla's autotuners tuned (keys no table served) becomes the job's. Every rank's
        choices, merged in rank order, go to every rank (:func:`share_autotuned`: from the next launch on, the ranks
        run the same configurations) and are kept for later starts: in the run folder by rank 0 (read at the job's
        next start on whatever nodes it lands), and in ``job.cache_folder`` by each node's first local rank (for the
        node's next processes of any job). Only with ``model.kernel_configs = auto``: ``off`` asks for autotuning
        and a path names the one file to use. Every rank calls it, once, right after its first step; whether it
        gathers depends only on settings every rank shares (a rank whose kernels fell back to the reference sends
        nothing, and still takes part)."""
        from hola_titan.kernels.runtime import tuned_configs

        if (self.config.model.kernel_configs != "auto" or self.device.type != "cuda"
                or self.config.model.attention_backend == "reference" or not self.model_args.is_recurrent):
            return
        # Keys served from a job's or node's autotuned file too: another node's cache may hold another choice.
        mine = tuned_configs.tuned_entries(served_here=True) if self.attention_backend != "reference" else {}
        kernels = share_autotuned(mine, distributed=self.world_size > 1, group=self._control_group)
        if not kernels:
            return
        v = tuned_configs.versions()
        gpu = torch.cuda.get_device_name(self.device)
        places = []
        if self.rank == 0:
            places.append((tuned_configs.node_tuned_file(self.dump, gpu, v["fla"], v["triton"]),
                           "the job's next starts (any node)"))
        folder = node_cache_folder(self.config)
        if folder is not None and self.device.index in (None, 0):
            places.append((tuned_configs.node_tuned_file(folder, gpu, v["fla"], v["triton"]),
                           "the next processes on this node"))
        for path, whom in places:
            try:
                added = tuned_configs.keep_node_tuned(path, kernels, gpu=gpu, versions=v)
            except OSError as err:
                logger.warning("kernel configurations autotuned at the first step not kept in %s (%s): %s "
                               "autotune them again", path, err, whom)
                continue
            if added:
                logger.info("kernel configurations: %d entries autotuned at the first step kept in %s for %s",
                            added, path, whom)

    def _install_kernel_configs(self, located):
        """fla's launch configurations, installed before any fla kernel launches (and before the model is built)."""
        from hola_titan.kernels.runtime.tuned_configs import Installed, install

        if located.path is None:
            return located
        if self.attention_backend == "reference":
            return Installed("off", None, "no fla kernels in this run")
        return install(located, self.device)

    def _compute_dtype(self) -> torch.dtype:
        """What the token mixers' kernels compute in: bf16 (autocast, or FSDP's bf16 parameters) or float32."""
        return torch.bfloat16 if self.config.training.mixed_precision_param == "bfloat16" else torch.float32

    def _plan_key(self) -> str:
        """This run's kind as the compile plans name it (hola_titan/kernels/runtime/precompile.py: plan_key)."""
        from hola_titan.kernels.runtime import precompile
        from hola_titan.kernels.gdn.fla_bridge import padded_head_dim

        dtype = str(self._compute_dtype()).removeprefix("torch.")
        return precompile.plan_key(self.model_args.flavour, padded_head_dim(self.model_args.head_dim, self.device),
                                   self.model_args.n_heads // self.dims.tp, dtype, packed=self.config.data.varlen)

    def _start_precompile(self, located):
        """Start compiling the plan for this kind of run (``model.precompile_workers``;
        hola_titan/kernels/runtime/precompile.py)."""
        from hola_titan.kernels.runtime import precompile

        workers = self.config.model.precompile_workers
        if located.path is None:
            return precompile.Precompile(source=f"no kernel configurations file: {located.why}")
        if workers == 0:
            return precompile.Precompile(source="model.precompile_workers = 0")
        specs, source = precompile.select(located.plans, self._plan_key())
        if not specs:
            return precompile.Precompile(source=f"{source} in {located.path}")
        if workers < 0:
            workers = precompile.auto_workers(len(specs),
                                              local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return precompile.start(specs, source=source, workers=workers, imports_done=False)

    def _join_precompile(self) -> None:
        if self.precompile is None or not self.precompile.workers:
            return
        result = self.precompile.wait()
        if self.rank == 0:
            logger.info("kernel precompile: %s", self.precompile.describe())
            if result["failed"]:
                logger.warning("kernel precompile: %d specialisation(s) did not compile in a worker (they compile at "
                               "their launch): %s", len(result["failed"]), "; ".join(result["failed"][:5]))

    def _layer_backward(self) -> str:
        """How a HOLA layer's backward runs on the Triton backend: overlapped (one op, the cache read's backward on a
        side stream beside fla's) or layered, and why (``model.overlap_backward``, hola/triton_layer.applies)."""
        if self.model_args.evict == "none":
            return ""
        if self.attention_backend == "fa4":
            return ", layered backward (the fa4 read is its own op)"
        if self.attention_backend != "triton":
            return ""
        model = self.config.model
        if not overlap_backward(model):
            why = "model.save_cache_output" if model.overlap_backward is None else "model.overlap_backward false"
            return f", layered backward ({why})"
        if self.model_args.cache_mix != "before_norm":
            return f", layered backward (model.cache_mix {self.model_args.cache_mix}: the overlapped op fuses the sum)"
        from hola_titan.kernels.hola.triton_layer import layered_because
        why = layered_because(self.model_args.head_dim, self.device)
        if why is not None:
            return f", layered backward ({why})"
        return ", overlapped backward" + ("; context-parallel shards run the layered form" if self.dims.cp > 1 else "")

    def _resolved_paths(self) -> dict[str, str]:
        """Which implementation runs each part of the step, as resolved for this run (logged at start-up)."""
        config = self.config
        paths = {"precision": ("fp32_master (float32 weights, bf16 autocast)" if self.autocast else
                               f"param {config.training.mixed_precision_param} (FSDP mixed precision)"
                               if self.dims.fsdp_enabled or self.dims.hsdp_enabled else "float32"),
                 "compile": "per block" if config.compile.enable else "off"}
        if self.model_args.is_recurrent:
            paths["layer"] = self.model_args.describe_layer()
            paths["attention_backend"] = f"{self.attention_backend} ({self._backend_why})" + self._layer_backward()
            if self.model_args.evict != "none" and self.attention_backend == "triton":
                from hola_titan.kernels.hola.triton_kernels import describe_cache_backward, describe_cache_forward
                paths["cache_forward"] = describe_cache_forward(self.model_args.head_dim, self._compute_dtype(),
                                                                self.device) + (
                    "; continuing context-parallel shards run the Triton kernels" if self.dims.cp > 1 else "")
                paths["cache_backward"] = describe_cache_backward(
                    self.model_args.head_dim, self._compute_dtype(), self.device,
                    kept_output=config.model.save_cache_output, deterministic=config.training.deterministic) + (
                    "; continuing context-parallel shards run the Triton kernels, delta over the keys"
                    if self.dims.cp > 1 else "")
            if self.model_args.evict != "none" and self.attention_backend == "fa4":
                from hola_titan.kernels.hola.fa4 import FA4_VERSION
                paths["cache_forward"] = paths["cache_backward"] = (
                    f"FlashAttention-4 {FA4_VERSION} varlen (sm_90, hola_titan/kernels/hola/fa4.py); calls "
                    "continuing from a cache (context-parallel shards) run the reference")
            paths["short_conv"] = ("triton (fused q|k|v, hola_titan/kernels/fused/short_conv.py) where it applies, "
                                   "else PyTorch" if self.kernels == "triton" else "PyTorch reference")
            paths["kernel_configs"] = self.kernel_configs.describe()
            paths["kernel_precompile"] = self.precompile.describe()
        paths["cross_entropy"] = ("triton (hola_titan/kernels/fused/cross_entropy.py, bf16 logits)"
                                  if self.loss_kernel else
                                  f"PyTorch (chunked, {str(self.head_matmul_dtype).removeprefix('torch.')} matmuls)")
        paths["optimizer"] = ("fused AdamW (non-finite steps skipped on the device)" if self._fused_optimizer
                              else "AdamW (foreach)") + describe_cache_optimizer(self.model_args, config.optimizer)
        return paths

    # ------------------------------------------------------------------ the step

    def _all_reduce_sum(self, value: torch.Tensor, mesh_dim: str = "dp_cp") -> torch.Tensor:
        group_mesh = submesh(self.mesh, mesh_dim)
        if group_mesh is not None and group_mesh.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group_mesh.get_group())
        return value

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The forward of one micro-batch (a loader batch on the host): the summed loss over its valid targets,
        a device scalar (its backward is the caller's: :meth:`train_step` scales it by the global target count).
        Public for the benchmarks, which time the phases of a step."""
        # Through pinned memory: a copy from pageable host memory waits for everything queued on the device.
        tokens = _to_device(batch["input_ids"], self.device)
        labels = _to_device(batch["labels"], self.device)
        context = self.batch_context(batch, tokens.numel())
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        if self.dims.tp > 1:
            # Under tensor parallelism the logits stay sharded over the vocabulary: a loss-parallel cross-entropy.
            with ctx:
                logits = self.model(tokens, context=context)
            with loss_parallel():
                return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum")
        # Otherwise the head and the loss run in chunks of rows and the [B*T, V] logits never exist (see
        # hola_titan/loss.py). ``flat_hidden_states`` is registered as an FSDP forward method (apply_fsdp), and the
        # root keeps its parameters gathered after forward, so ``output_weight()`` is the unsharded (tied) head here.
        with ctx:
            hidden = self.model.flat_hidden_states(tokens, context=context)
        return chunked_linear_cross_entropy(hidden, self.model.output_weight(), labels.flatten(),
                                            chunk_size=self.config.training.loss_chunk_size,
                                            ignore_index=IGNORE_INDEX, matmul_dtype=self.head_matmul_dtype,
                                            kernel=self.loss_kernel)

    def batch_context(self, batch: dict, num_tokens: int) -> BatchContext:
        """The model's per-batch context: the documents checked from the loader's host copy (so no layer reads the
        device copy back, a host-device synchronisation) and, under context parallelism, this rank's view of
        the shard. Made per forward; a recomputed forward (activation checkpointing) keeps the one it ran with."""
        documents = None
        if batch.get("cu_seqlens") is not None:
            documents = Documents.from_host(batch["cu_seqlens"], device=self.device, seq_len=num_tokens)
        cp = self.cp.batch(batch["cp_layout"]) if self.cp is not None else None
        return BatchContext(documents=documents, cp=cp)

    def train_step(self, micro_batches: list[dict]) -> PendingStep:
        """Queue one optimizer step over this rank's micro-batches; its reduced numbers arrive through the
        returned :class:`PendingStep` (see the module docstring: nothing here waits for the GPU)."""
        if self.cp is not None:
            micro_batches = [self.cp.shard_batch(b) for b in micro_batches]
        targets = self._global_targets(micro_batches)
        # FSDP averages gradients over its ranks; scale so that the average is the global-batch mean.
        ranks = self.dims.dp * self.dims.cp if self.mesh is not None else 1
        grad_scale = ranks / targets
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro_batches:
            loss_sum = self.loss_sum(batch)
            loss_ctx = loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext()
            with loss_ctx:
                (loss_sum * grad_scale).backward()
            loss_total += _full(loss_sum.detach()).double()
        if self.gradient_probe is not None:
            self.gradient_probe(self)
        loss_total = self._all_reduce_sum(loss_total.reshape(1)).reshape(())
        grad_norm = self.clip_grad_norm()
        finite = torch.isfinite(loss_total) & torch.isfinite(grad_norm)
        spike, ema_before = self._loss_spike_guard(loss_total / targets, finite)
        watched = self._watch_steps > 0
        self._watch_steps = max(0, self._watch_steps - 1)
        ok = finite & ~spike
        # The previous step's numbers are due now, before this step can update the weights.
        self.resolve_pending()
        if self._fused_optimizer:
            # The fused AdamW leaves weights, moments and its step count unchanged where found_inf is 1.
            self.optimizer.found_inf = (~ok).float()
            self.optimizer.step()
        elif bool(ok):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        tokens_before = self.state.tokens_seen
        self.state.step += 1
        self.state.tokens_seen += self.degrees.global_batch_size * self.config.training.seq_len
        self._pending = PendingStep(step=self.state.step, tokens_before=tokens_before, lr=lr, loss_sum=loss_total,
                                    targets=targets, grad_norm=grad_norm, finite=finite, spike=spike,
                                    loss_ema=ema_before, watched=watched)
        return self._pending

    def resolve_pending(self) -> dict | None:
        """Read the last queued step's numbers (waiting for that step only) and act on a non-finite one: count it
        as skipped (``training.skip_nan_inf``) or raise :class:`NonFiniteLossError`. Idempotent."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        result = pending.result()
        self._judge(pending.step, result)  # before a bad loss stops the run: its checkpoint is marked first
        if result["ok"]:
            self._consecutive_skips = 0
            return result
        cfg = self.config.training
        if result["finite"]:
            why = (f"loss {result['loss']:.4g} at step {pending.step} is more than {cfg.loss_spike_factor:g} times the "
                   f"running mean {result['loss_ema']:.4g} of the previous steps (training.loss_spike_factor)")
        else:
            why = f"loss {result['loss']} / grad norm {result['grad_norm']} at step {pending.step} is not finite"
        if pending.watched:
            # Right after a resume this is the checkpoint's fault, not the data's: skipping cannot help.
            self.state.step, self.state.tokens_seen = pending.step - 1, pending.tokens_before
            raise NonFiniteLossError(
                f"training: the first steps after the resume do not continue the checkpoint's run ({why}); its weights "
                "or optimizer state look damaged, and nothing was saved over it: resume from an earlier checkpoint "
                "(checkpoint.load_step)")
        if cfg.skip_nan_inf:
            self.state.skipped_steps += 1
            self._consecutive_skips += 1
            logger.warning("step %d skipped (training.skip_nan_inf): %s", pending.step, why)
            if self._consecutive_skips >= cfg.max_consecutive_skips:
                self.state.step, self.state.tokens_seen = pending.step - 1, pending.tokens_before
                raise NonFiniteLossError(
                    f"training: {self._consecutive_skips} consecutive steps skipped, up to step {pending.step} "
                    f"(training.max_consecutive_skips = {cfg.max_consecutive_skips}): the run is diverging; last: "
                    f"{why}")
            return result
        # The counters end at the last step that updated the weights (the run stops here).
        self.state.step, self.state.tokens_seen = pending.step - 1, pending.tokens_before
        raise NonFiniteLossError(f"training: {why}; stopped before its optimizer update, nothing was written for "
                                 "this step (set training.skip_nan_inf = true to skip such steps)")
        return result

    def _loss_spike_guard(self, loss: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: whether this step's mean loss spikes over the running mean of the accepted steps
        (``training.loss_spike_factor``), and that mean before the step; updates the mean with an accepted step."""
        cfg = self.config.training
        ema, seen = self._loss_ema, self._loss_ema_steps
        spike = torch.zeros((), dtype=torch.bool, device=self.device)
        if cfg.loss_spike_factor > 0:
            # The first steps after a resume are held to the checkpoint's running mean at once, warm-up or not: a
            # damaged checkpoint shows there, and must stop the run before anything is saved over it.
            armed = (seen >= cfg.loss_spike_warmup) | ((seen > 0) & (self._watch_steps > 0))
            spike = finite & armed & (loss > cfg.loss_spike_factor * ema)
        accepted = finite & ~spike
        updated = torch.where(seen > 0, 0.9 * ema + 0.1 * loss, loss)
        self._loss_ema = torch.where(accepted, updated, ema)
        self._loss_ema_steps = seen + accepted.double()
        return spike, ema

    def _healthy(self, result: dict) -> bool:
        """Whether a step passed the health checks that retention keeps a checkpoint for: a finite loss and norm,
        no spike, and (with the spike guard on, whether or not it is armed yet) a loss within
        ``training.loss_spike_factor`` of the running mean of the steps before."""
        factor = self.config.training.loss_spike_factor
        within = not (factor > 0 and result["loss_ema"] > 0 and result["loss"] > factor * result["loss_ema"])
        return bool(result["finite"]) and not result["spike"] and within

    def _judge(self, step: int, result: dict) -> None:
        """The loss of ``step`` (``result``) is the first computed from the weights of the checkpoint of step
        ``step - 1`` when that one is unjudged: record whether it is healthy (:meth:`_healthy`)."""
        saved = self._unjudged
        if saved is None or step != saved + 1:
            return
        self._unjudged = None
        if self.checkpointer is None:
            return
        factor = self.config.training.loss_spike_factor
        healthy = self._healthy(result)
        if not result["finite"]:
            why = f"loss {result['loss']} / grad norm {result['grad_norm']} at step {step} from its weights"
        elif factor > 0 and result["loss_ema"] > 0:
            why = (f"loss {result['loss']:.4g} at step {step} from its weights, "
                   f"{'within' if healthy else 'more than'} {factor:g} times the running mean "
                   f"{result['loss_ema']:.4g} (training.loss_spike_factor)")
        else:
            why = f"loss {result['loss']:.4g} at step {step} from its weights is finite"
        self.checkpointer.record_health(saved, HEALTHY if healthy else UNHEALTHY, why)

    def _judge_last_checkpoint(self, data_iter) -> None:
        """The run's last checkpoint has no next step to judge it: one forward of the next global batch (no update)
        computes the loss its weights give, which :meth:`_judge` reads as that step's. With gradients enabled, as in
        training, so that compiled blocks run the graphs they have (under ``no_grad`` they would compile again, at
        the end of every run); each micro-batch's graph is dropped as soon as its loss is read."""
        micro = [next(data_iter) for _ in range(self.degrees.grad_accum_steps)]
        if self.cp is not None:
            micro = [self.cp.shard_batch(b) for b in micro]
        targets = self._global_targets(micro)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro:
            loss_total += _full(self.loss_sum(batch)).detach().double()
        loss_total = self._all_reduce_sum(loss_total.reshape(1)).reshape(())
        loss = float(loss_total / targets)
        result = {"loss": loss, "grad_norm": float("nan"), "finite": math.isfinite(loss), "spike": False,
                  "loss_ema": float(self._loss_ema)}
        self._judge(self.state.step + 1, result)

    def _weights_health(self) -> tuple[str, str]:
        """``(UNHEALTHY, why)`` when a weight of the model about to be saved is not finite (on any rank), else
        ``(UNJUDGED, "")``: the next loss judges it. One read of the device, on save steps only."""
        tensors = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
        # A rank whose shards are all empty (a tiny model over many ranks) has nothing non-finite.
        finite = torch.stack(checks).all() if checks else True
        flag = torch.tensor([int(finite)], dtype=torch.int64)
        if self._control_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._control_group)
        if int(flag.item()):
            return UNJUDGED, ""
        return UNHEALTHY, "its weights are not all finite"

    def _store_guard_state(self) -> None:
        """Copy the spike guard's device state into the checkpointed counters (reads the device: save steps only)."""
        self.state.loss_ema = float(self._loss_ema)
        self.state.loss_ema_steps = int(self._loss_ema_steps)

    def _restore_guard_state(self) -> None:
        self._loss_ema = torch.tensor(self.state.loss_ema, dtype=torch.float64, device=self.device)
        self._loss_ema_steps = torch.tensor(float(self.state.loss_ema_steps), dtype=torch.float64,
                                            device=self.device)

    def _global_targets(self, micro_batches: list[dict]) -> float | torch.Tensor:
        """Valid targets of the whole global batch: counted on the host from the loader's host tensors (a float
        when this rank's count is the global one), else summed over the data- and context-parallel ranks on the
        device (a tensor, never read back)."""
        labels = [b["labels"] for b in micro_batches]
        if all(x.device.type == "cpu" for x in labels):
            local = sum(int((x != IGNORE_INDEX).sum()) for x in labels)
            group_mesh = submesh(self.mesh, "dp_cp")
            if group_mesh is None or group_mesh.size() == 1:
                return max(float(local), 1.0)
            value = to_device(torch.tensor([float(local)], dtype=torch.float64), self.device)
        else:
            value = sum((x != IGNORE_INDEX).sum() for x in labels).double().reshape(1)
        return self._all_reduce_sum(value).reshape(()).clamp_min(1.0)

    def clip_grad_norm(self) -> torch.Tensor:
        """Global gradient norm as a (device) tensor; clips to ``training.max_norm`` without reading it."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        if self.config.training.max_norm > 0:
            # A non-finite norm zeroes or poisons the gradients here; that step's update is skipped anyway.
            torch.nn.utils.clip_grads_with_norm_(params, self.config.training.max_norm, total)
        return total


    # ------------------------------------------------------------------ validation

    def _validation_loader(self):
        """The held-out documents of the training data, or ``validation.dataset`` read whole: the same batches at
        every validation. Each of the ``validation.steps`` batches is one global batch of the run
        (``training.global_batch_size`` rows, read as this rank's accumulation micro-batches), so the rows, hence
        ``val_loss``, do not depend on the layout. Raises ``DataError`` for data smaller than one such batch."""
        from hola_titan.data import build_validation_dataloader

        config = self.config
        return build_validation_dataloader(data=config.data, dataset=config.validation.dataset,
                                           tokenizer=self.tokenizer, seq_len=config.training.seq_len,
                                           local_batch_size=config.training.local_batch_size, dp_rank=self.dp_rank,
                                           dp_world_size=self.dp_size, max_batches=config.validation.steps,
                                           accumulation=self.degrees.grad_accum_steps,
                                           token_cache=token_cache_folder(config),
                                           hash_cache=data_hash_folder(config))

    def _checked_validation_loader(self):
        """:meth:`_validation_loader`, refused in one line when the validation data holds fewer than
        ``validation.steps`` global batches (counted for data held in memory; streamed data is checked for one
        batch when the loader is built, and a validation says when it ends sooner). Called before the first step:
        found at the first validation, the same mistake cost every step since the last checkpoint."""
        config = self.config
        loader = self._validation_loader()
        held = len(loader) // self.degrees.grad_accum_steps
        if held < config.validation.steps:
            raise ConfigError("validation.steps", f"{config.validation.steps} global batches of "
                              f"{self.degrees.global_batch_size} rows x {config.training.seq_len} tokens, but the "
                              f"validation data ({config.validation.dataset or config.data.dataset}) holds {held}; "
                              f"at most {held}")
        return loader

    @torch.no_grad()
    def validate(self) -> dict:
        """The mean loss over every valid target of the ``validation.steps`` global batches of validation data (as
        training's loss, independent of the layout)."""
        if self._validation is None:
            self._validation = self._checked_validation_loader()
        self.model.eval()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)
        micro_batches = 0
        for batch in self._validation:
            if self.cp is not None:
                batch = self.cp.shard_batch(batch)
            loss_sum[0] += _full(self.loss_sum(batch)).double()
            loss_sum[1] += float((batch["labels"] != IGNORE_INDEX).sum())
            micro_batches += 1
        self._all_reduce_sum(loss_sum)
        self.model.train()
        read, wanted = micro_batches // self.degrees.grad_accum_steps, self.config.validation.steps
        if read < wanted and self.rank == 0:
            logger.warning("validation: the streamed validation data ended after %d of the %d global batches of "
                           "validation.steps; val_loss is over those", read, wanted)
        val_loss = float(loss_sum[0] / loss_sum[1].clamp(min=1))
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def cache_scalars(self) -> dict:
        """Per HOLA layer, in order, the mean over heads of the cache read's weight ``sigmoid(gate)`` and of the sink
        logit, and the mean over the head dim of ``gamma_q * gamma_k`` (each dimension's factor in the cache's
        logits, 1 at init; the paper's "RMSNorm-gamma sharpening" raises it, weight decay pulls it down):
        ``{"cache_gate": [...], "cache_sink": [...], "cache_gamma_qk": [...]}``, or ``{}`` for a model without a
        cache. Logged with each validation: how far training moves the layer from its init (gate -4: 0.018) shows
        whether it leans on the cache or away from it. A sharded parameter is gathered whole (every rank validates
        at the same step, so the collective is met)."""
        from hola_titan.models.model import GatedDeltaMixer

        gates, sinks, gammas = [], [], []
        for module in self.model.modules():
            if isinstance(module, GatedDeltaMixer) and module.settings.evict != "none":
                gate, sink, gamma_q, gamma_k = (_full(p.detach()).float() for p in
                                                (module.gate, module.sink, module.gamma_q, module.gamma_k))
                gates.append(float(torch.sigmoid(gate).mean()))
                sinks.append(float(sink.mean()))
                gammas.append(float((gamma_q * gamma_k).mean()))
        return {"cache_gate": gates, "cache_sink": sinks, "cache_gamma_qk": gammas} if gates else {}

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict]:
        """Train to ``training.steps``; returns the logged rows (also written to ``metrics.jsonl``)."""
        config = self.config
        if not self._folder_locks:  # a second train() of this trainer
            self._lock_folders()
        try:
            resumed = None
            if self._loader is not None:
                resumed = self._loader.load(resume=self.checkpointer is not None)
                if resumed is not None:
                    self._apply_resume_changes()
                    self._watch_steps = self.WATCHED_STEPS
                    # The first loss from the resumed weights judges them, when their checkpoint was still unjudged
                    # (saved at a stop, or by a run that ended before its next step): record_health keeps a verdict.
                    self._unjudged = self._loader.resumed_step
                self._restore_guard_state()
            # Before the first step (and after a resume settled the global batch): validation data that cannot
            # serve validation.steps is refused now, not after the steps up to the first validation.
            self._validation = self._checked_validation_loader() if config.validation.enable else None
            self.paths["weights"] = self._weights_record()
            self._write_run_record()
            if self.rank == 0:
                logger.info("%s", self._summary(resumed))
                from hola_titan.data.loader import repetition_note
                note = repetition_note(self.dataloader, steps=config.training.steps,
                                       rows_per_step=self.degrees.global_batch_size)
                if note:
                    logger.warning("data: %s", note)
                warning = schedule_warning(config)
                if warning:
                    logger.warning("%s", warning)
            gc_freq = config.training.gc_freq
            was_enabled = gc.isenabled()
            if gc_freq:
                gc.disable()
                gc.collect(1)
            try:
                with self._stop_signals():
                    return self._train_loop(gc_freq)
            finally:
                if gc_freq and was_enabled:
                    gc.enable()
        finally:
            # The run is over (or failed): its folders are free for the next one, whenever this object is collected.
            for lock in self._folder_locks:
                lock.release()
            self._folder_locks = []

    STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    WATCHED_STEPS = 3  # after a resume, steps whose loss must stay within training.loss_spike_factor of the mean

    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGTERM (what schedulers send before a kill), SIGUSR1 and SIGINT (Ctrl-C) ask the loop to save a
        checkpoint at the next step boundary and end cleanly (see :meth:`_stop_requested`); a second SIGINT stops at
        once (:func:`_second_interrupt`). Installed in the main thread only."""
        self._stop_signal = _EARLY_STOP[0] if _EARLY_STOP else None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            _second_interrupt(signum, self._stop_signal)
            self._stop_signal = signum

        previous = {sig: signal.signal(sig, handler) for sig in self.STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _stop_requested(self) -> int | None:
        """The stop signal received by any rank (all ranks agree, over a CPU group, so they stop at one step)."""
        local = self._stop_signal or 0
        if self._control_group is not None:
            flag = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control_group)
            local = int(flag.item())
        return local or None

    def _stop_at(self, step: int, signum: int, *, saved: bool) -> None:
        """End the run after ``step`` on a stop signal: that step's checkpoint written (when checkpointing is on)."""
        name = signal.Signals(signum).name
        self.resolve_pending()
        if self.checkpointer is None:
            logger.warning("%s received: stopping after step %d without a checkpoint (checkpoint.enable is false)",
                           name, step)
            return
        if not saved:
            self._store_guard_state()
            health, why = self._weights_health()
            self.checkpointer.save(step, health=health, why=why)
            self._unjudged = step if health == UNJUDGED else None
        logger.info("%s received: stopped after step %d with its checkpoint in %s; run again to resume", name, step,
                    self.checkpointer.folder)

    def _weights_record(self) -> str:
        """Which weights this run started from (logged, and in paths.json and config.toml): its own random
        initialisation, a resumed checkpoint, a model-only checkpoint of its folder, or checkpoint.initial_load_path."""
        source = self._loader.started_from if self._loader is not None else None
        if source is None:
            return f"random init (training.seed {self.config.training.seed})"
        if source["kind"] == "resumed":
            return f"resumed after step {source['step']} from {source['path']}"
        if source["kind"] == "model_only":
            return f"model-only checkpoint {source['path']} (weights only, from step 0)"
        given, path = source["given"], source["path"]
        return (f"checkpoint.initial_load_path {given}" + (f" ({path})" if Path(path) != Path(given) else "")
                + " (weights only, from step 0)")

    def _summary(self, resumed: int | None) -> str:
        """The start-up block: what runs, where, on what data, from where."""
        config, d = self.config, self.degrees
        paths = self.paths
        mixer = paths["attention_backend"] if self.model_args.is_recurrent else "PyTorch SDPA"
        data = config.data
        val = ("off" if not config.validation.enable else
               f"{config.validation.dataset or data.dataset} ({config.validation.steps} global batches of "
               f"{d.global_batch_size} rows every {config.validation.freq} steps)")
        tag = getattr(self.dataloader, "holdout", "none")  # local data without split folders only
        holdout = f", every {tag.split('/')[1]}th document held out for validation" if tag != "none" else ""
        start = f"resuming after step {resumed}" if resumed is not None else "step 0"
        ckpt = (f"every {config.checkpoint.interval} steps to {self.checkpointer.folder}"
                if self.checkpointer is not None else "off")
        about = f" ({config.job.description})" if config.job.description else ""
        lines = [
            f"run in {self.dump}{about}: {start}, training to step {config.training.steps} (attempt "
            f"{self.metrics.attempt} in this folder)",
            f"  model: {self.model_args.flavour} {self.model_args.size}, {self.num_params:,} parameters, vocabulary "
            f"{self.model_args.vocab_size} (tokenizer {config.model.tokenizer_path})",
            f"  layout: {self.world_size} process(es) on {self.device.type}: data-parallel {d.dp_replicate} x "
            f"{d.dp_shard}, tensor {d.tp}, context {d.cp}; global batch {d.global_batch_size} rows x "
            f"{config.training.seq_len} tokens, {d.grad_accum_steps} accumulation step(s)",
            *([f"  layer: {paths['layer']}"] if "layer" in paths else []),
            f"  compute: {paths['precision']}; compile {paths['compile']}; token mixer {mixer}; short convolution "
            f"{paths.get('short_conv', '-')}; cross-entropy {paths['cross_entropy']}; {paths['optimizer']}",
            *([f"  fla kernel configurations: {paths['kernel_configs']}"] if "kernel_configs" in paths else []),
            *([f"  kernel precompile: {paths['kernel_precompile']}"] if "kernel_precompile" in paths else []),
            f"  data: {data.dataset} split {data.split} (text field {data.text_field}{holdout}); validation {val}",
            f"  weights: {paths['weights']}",
            f"  checkpoints: {ckpt}",
            # Three significant digits: a CPU's measured rate is a few hundredths of a TFLOP/s, which .1f showed as 0.0.
            f"  MFU against {self.peak_tflops:.3g} TFLOP/s ({self._peak_source}); matmul rate measured here "
            f"{self.measured_tflops:.3g} TFLOP/s (mfu_measured)",
        ]
        return "\n".join(lines)

    def _write_run_record(self) -> None:
        """The run's record in its folder (rank 0): the resolved ``config.toml`` and ``paths.json``, this process's
        line in ``attempts.jsonl``, and the metrics files opened for appending. Only after the checkpoint loaded: a
        resume that fails leaves the record of the run that wrote the checkpoints, which export and conversion
        read."""
        if self.rank == 0:
            write_resolved(self.config, self.dump, resolved=self.paths)
            write_text_atomic(self.dump / "paths.json", json.dumps(self.paths, indent=1) + "\n")
        if self.metrics is None:
            # Rank 0 records this process as the folder's next attempt (hola_titan/metrics_records.py).
            self.metrics = MetricsLogger(self.dump, enabled=self.rank == 0,
                                         tensorboard=self.config.metrics.enable_tensorboard,
                                         tb_folder=self.config.metrics.save_tb_folder, start_step=self.state.step,
                                         total_steps=self.config.training.steps)

    def _train_loop(self, gc_freq: int) -> list[dict]:
        config = self.config
        rows = []
        shared_autotuned = False
        data_iter = iter(self.dataloader)
        self.model.train()
        window_start, window_tokens = time.perf_counter(), 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with step_profiler(config.profiling, folder=self.dump / config.profiling.traces_folder, rank=self.rank,
                           device=self.device, step_of=lambda: self.state.step) as prof:
            while self.state.step < config.training.steps:
                micro = [next(data_iter) for _ in range(self.degrees.grad_accum_steps)]
                pending = self.train_step(micro)
                if not shared_autotuned:  # every autotuner of the step has chosen by now (launches are on the host)
                    shared_autotuned = True
                    self._keep_autotuned()
                if gc_freq and self.state.step % gc_freq == 0:
                    gc.collect(1)
                window_tokens += self.degrees.global_batch_size * config.training.seq_len
                step = self.state.step
                final = step == config.training.steps
                validating = config.validation.enable and (step % config.validation.freq == 0 or final)
                saving = self.checkpointer is not None and self.checkpointer.due(step, final=final)
                logging_now = step % config.metrics.log_freq == 0 or final or step == 1
                if logging_now or validating or saving:
                    # The step's numbers are needed on the host (and a non-finite step must stop the run before
                    # anything is written for it); other steps are checked by the next step.
                    self.resolve_pending()
                if logging_now:
                    result = pending.result()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    tps_device = window_tokens / elapsed / self.world_size
                    row = {"step": step, "loss": result["loss"], "grad_norm": result["grad_norm"],
                           "lr": result["lr"], "tokens_per_s": tps_device * self.world_size,
                           "tokens_per_s_per_device": tps_device,
                           "mfu": self.flops["total"] * tps_device / (self.peak_tflops * 1e12),
                           "mfu_measured": self.flops["total"] * tps_device / (self.measured_tflops * 1e12),
                           "memory_gib": peak_memory_gib(self.device), "tokens_seen": self.state.tokens_seen}
                    if not rows:  # the first row of this run says what ran (as paths.json and config.toml do)
                        row["paths"] = self.paths
                        if self.kernel_configs.path is not None:
                            # Known only now: which kernel launches the shipped configurations served.
                            row["kernel_configs"] = self.kernel_configs.record()
                            if self.rank == 0:
                                logger.info("kernel configurations after the first step: %s",
                                            self.kernel_configs.served.summary())
                    rows.append(row)
                    self.metrics.log(row)
                    window_start, window_tokens = time.perf_counter(), 0
                if saving:
                    self._store_guard_state()
                if self.checkpointer is not None:
                    # Weights that are not finite are unhealthy at once; finite ones wait for the next loss (_judge).
                    health, why = self._weights_health() if saving else (UNJUDGED, "")
                    if self.checkpointer.maybe_save(step, final=final, health=health, why=why):
                        self._unjudged = step if health == UNJUDGED else None
                if validating:
                    # After the step's checkpoint: a validation that fails (its data, the device) must not cost the
                    # steps since the last one. A background save is finished before the error ends the run.
                    try:
                        row = {"step": step, **self.validate(), **self.cache_scalars()}
                    except Exception as err:
                        if self.checkpointer is not None and not isinstance(err, InterruptedTwice):
                            self.checkpointer.finish()
                        raise
                    rows.append(row)
                    self.metrics.log(row)
                prof.step()
                stop = None if final else self._stop_requested()
                if stop is not None:
                    self._stop_at(step, stop, saved=saving)
                    break
        self.resolve_pending()
        if self.checkpointer is not None:
            if self._unjudged is not None and self._unjudged == self.state.step == config.training.steps:
                self._judge_last_checkpoint(data_iter)
            self.checkpointer.close()
        self.metrics.close()
        if self.rank == 0:
            last = next((r for r in reversed(rows) if "loss" in r), None)
            logger.info("run ended at step %d of %d%s; %s", self.state.step, config.training.steps,
                        f", last logged loss {last['loss']:.4f}" if last and last["loss"] is not None else "",
                        f"checkpoints in {self.checkpointer.folder}" if self.checkpointer is not None
                        else "no checkpoints (checkpoint.enable is false)")
        return rows


# A stop signal received before the training loop started (set by main's handler, read by Trainer.train).
_EARLY_STOP: list[int] = []


class InterruptedTwice(Exception):
    """A second Ctrl-C while the first one's checkpoint was still pending: the user wants out now."""


_INTERRUPTED_TWICE: list[bool] = []


def _second_interrupt(signum: int, pending: int | None) -> None:
    """Raise :class:`InterruptedTwice` for a SIGINT that follows an earlier SIGINT (Ctrl-C pressed again). Also
    recorded, since a library may wrap the exception (DCP does, when the interrupt lands in a save)."""
    if signum == signal.SIGINT and pending == signal.SIGINT:
        _INTERRUPTED_TWICE.append(True)
        raise InterruptedTwice


def _remember_stop_signals() -> None:
    """From the start of the process: a SIGTERM, SIGUSR1 or SIGINT that arrives while the trainer is still being
    built is kept, and the loop stops after its first step. (Under ``run_train.sh`` torchrun ignores the three, so a
    signal to the whole job reaches the workers and not the agent that would kill them.)"""
    def handler(signum, frame):
        _second_interrupt(signum, _EARLY_STOP[0] if _EARLY_STOP else None)
        if not _EARLY_STOP:
            _EARLY_STOP.append(signum)

    for sig in Trainer.STOP_SIGNALS:
        signal.signal(sig, handler)


# How long a worker whose torchrun has ended may take to save and exit before it ends at once (a save that waits
# for a rank that is gone would otherwise hold the run folder for ever).
ORPHAN_GRACE_S = 300.0


def _stop_when_orphaned(parent: int) -> None:
    """torchrun (process ``parent``) has ended, e.g. killed with ``run_train.sh`` (``kill -9``, which no trap sees):
    stop as on SIGTERM, the current step's checkpoint written at its boundary, and end with SIGKILL if still alive
    after ``ORPHAN_GRACE_S``. Runs in :func:`watch_parent`'s thread."""
    logger.warning("torchrun (process %d) has ended: stopping as on SIGTERM, saving at the next step boundary "
                   "(this process ends at once if still running in %.0f s)", parent, ORPHAN_GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler of the moment: before, during or after the training loop
    time.sleep(ORPHAN_GRACE_S)
    _one_line_error(f"torchrun (process {parent}) ended {ORPHAN_GRACE_S:.0f} s ago and this worker has not "
                    "finished its save: ending it (the checkpoints written before are intact)")
    os.kill(os.getpid(), signal.SIGKILL)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on ``device`` without waiting for the device (host tensors go through pinned memory)."""
    if tensor.device == device or tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    return to_device(tensor, device)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor, whole on every rank (a collective where it is sharded, so every rank must call
    it): the loss-parallel loss, or a sharded parameter read for the log."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def dry_run(config: JobConfig) -> None:
    """Print the resolved config, parameter count, training FLOPs per token, the batch and its accumulation, and a
    per-device memory estimate (:mod:`hola_titan.memory`); allocate no weights."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(config, world_size=world_size)
    args, tokenizer = model_args_of(config, tokenizer_optional=True)
    if tokenizer is None:
        print(f"note: the tokenizer {config.model.tokenizer_path!r} is not on disk; vocabulary {args.vocab_size} "
              "from model.vocab_size")
    model = build_model(args, device="meta")
    flops = flops_per_token(args, config.training.seq_len)
    print(to_toml(config))
    warning = schedule_warning(config)
    if warning:
        print(f"warning: {warning}")
    print(f"model: {args.flavour} {args.size}, {num_params(model):,} parameters, vocab {args.vocab_size}")
    parts = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in flops.items() if k != "total")
    print(f"training FLOPs per token: {flops['total'] / 1e9:.3f} GFLOP ({parts}) at seq_len {config.training.seq_len}")
    degrees = resolve_degrees(config.parallelism, config.training, world_size=world_size)
    print(batch_line(config, degrees))
    print("\n".join(describe(estimate_memory(args, config, degrees, model), config)))


def _one_line_error(message: str) -> int:
    """Print ``error: <message>`` and return exit status 2; under ``run_train.sh`` also leave the line in the file
    it names (``HOLA_TITAN_ERROR_FILE``), so that the launcher ends with status 2 and without torchrun's failure
    report."""
    line = f"error: {message}"
    print(line, file=sys.stderr)
    target = os.environ.get("HOLA_TITAN_ERROR_FILE")
    if target:
        try:
            with open(target, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass  # a full disk may be why we are here; the printed line stands
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    _remember_stop_signals()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun's workers run in sessions of their own: one whose torchrun is gone stops, not trains on.
        watch_parent(_stop_when_orphaned)
    setup_logging(rank)
    config = None
    try:
        config = parse_config(argv)
        if config.dry_run:
            if rank == 0:
                dry_run(config)
            return 0
        trainer = Trainer(config)
        trainer.train()
        del trainer  # its meshes and groups go before the process group does (end_process_group)
        end_process_group()
    except (ConfigError, NonFiniteLossError, FileNotFoundError, CheckpointError, DataError, InterruptedTwice) as err:
        if _INTERRUPTED_TWICE:  # the second Ctrl-C, also when a save it interrupted reports it as its own failure
            _one_line_error("interrupted twice: stopped at once, without saving the current step (the checkpoints "
                            "written so far are intact; an unfinished save is removed at the next start)")
            return 130
        return _one_line_error(str(err))
    except OSError as err:
        if err.errno not in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
            raise
        where = err.filename or (config.job.dump_folder if config is not None else ".")
        return _one_line_error(f"writing {where} failed: {describe_write_error(err, Path(where))}; or set "
                               "job.dump_folder elsewhere (the checkpoints written so far are intact)")
    finally:
        end_process_group(barrier=False)  # after an error: no barrier, a failed rank may be gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
