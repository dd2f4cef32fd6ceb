"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, resume, reshard, seed.

Layout on disk::

    <job.dump_folder>/config.toml               the resolved config (written by the trainer)
    <job.dump_folder>/<checkpoint.folder>/
        step-6/                                 a complete checkpoint: .metadata + __<rank>_0.distcp per rank,
                                                and manifest.json (size and xxh3 checksum of every file)
        step-12/
        step-18.tmp/                            a save in progress, or one a crash cut short: never loaded,
                                                removed when the run starts again

What a training checkpoint holds (DCP keys)::

    model.<fqn>              weights by the model's own names (``get_model_state_dict``; DTensor shards under FSDP;
                             the names of ``hola_titan.export``, without wrapper prefixes)
    optimizer.state.<fqn>.*  AdamW moments and step; ``optimizer.param_groups`` (``get_optimizer_state_dict``)
    lr_scheduler.*           LambdaLR state
    dataloader.*             global rows consumed (the same on every rank) and the checks of the loader
    train_state.*            step, tokens_seen, skipped_steps
    rng.rank<r>              python, numpy, torch CPU and CUDA generator states of rank r (pickled bytes)
    info.*                   checkpoint format version and the world size that saved it

A *model-only* checkpoint has only ``model.*`` (and ``info.*``): the seed checkpoint
(:func:`create_seed_checkpoint`) and ``scripts/import_safetensors.py`` write those.

Saving (:meth:`Checkpointer.maybe_save`, after every step): every ``checkpoint.interval`` steps and at the last
step. A save goes to ``step-N.tmp``; only when it is complete (every rank wrote its files and rank 0 wrote
``.metadata``) rank 0 renames it to ``step-N``, then removes verified checkpoints beyond the newest ``keep_latest_k``
(0 keeps all), never the one just written, the one resumed from or the newest recorded healthy; folders that do not
verify are not counted and are left in place (:meth:`Checkpointer._retain`). Each manifest records the saved model's
health, ``unjudged`` until the trainer's next loss judges it (:meth:`Checkpointer.record_health`).
A process killed mid-save therefore leaves at most a ``.tmp`` folder, which is never loaded as it is: at the next
start a ``.tmp`` whose metadata and data files are all whole (a finished save whose rename was cut short) is
promoted to ``step-N``, any other is removed.

- ``async_mode = "disabled"``: ``dcp.save``; the rename follows a barrier.
- ``async_mode = "async"``: ``dcp.async_save`` copies the state to CPU memory, then writes it in a background
  thread over a separate gloo process group while training goes on. Rank 0 renames the folder as soon as its
  future has resolved (DCP resolves it on rank 0 only after every rank's files and the metadata are written);
  every rank waits for its previous save before starting the next one, and :meth:`Checkpointer.close` waits for
  the last.

Loading (:meth:`Checkpointer.load`, before the loop):

1. ``checkpoint.load_step = N``: load ``step-N``; if it is missing, partial or corrupt, fail with an error naming it.
2. ``load_step = -1`` (default): the newest complete ``step-N``, logged as ``resuming from step N``. **Fallback**:
   if that checkpoint turns out unreadable (a data file missing or truncated, metadata that does not unpickle, a
   read error in DCP) the error is logged, naming the folder, and the previous complete checkpoint is tried, and
   so on; when none can be read the load fails naming every folder it tried. The broken folder is left in place
   for inspection (it is replaced when training saves that step again). A checkpoint that reads fine but does
   not fit the model (other flavour or size: missing keys or other shapes) is *not* a fallback case: that is a
   config mistake and fails at once (:class:`CheckpointMismatchError`), so a wrong config never silently
   resumes from an old step.

Integrity: every checkpoint folder carries ``manifest.json``, the size and checksum (xxh3-64) of each of its files,
written by rank 0 after every file is complete and before the rename that makes the folder a checkpoint. Before a
checkpoint's state is read, rank 0 checks every file against it; a file whose bytes changed (or that is missing or
of another size) makes the folder unreadable as above, named with the file: the fallback to the previous
checkpoint with ``load_step = -1``, an error with an explicit ``load_step``. A folder written before manifests
existed loads with a warning that its bytes are not verified. (Checking costs one read of the checkpoint: about
9 GB/s of hashing on one CPU core, so the disk sets the pace.)
3. No checkpoint in the folder: weights only from ``checkpoint.initial_load_path`` (a DCP checkpoint folder, full
   or model-only, a checkpoint or run folder, whose newest complete step is taken, or a safetensors export
   folder), starting at step 0; or a fresh start. With ``checkpoint.enable`` off (no saving, no resuming) the
   trainer still loads ``initial_load_path`` (``load(resume=False)``).

A model-only checkpoint found in the folder (the seed checkpoint ``step-0``) loads the weights and starts at
step 0 with fresh optimizer, schedule and data position.

Resharding: DCP stores every tensor with its global shape and each rank reads the pieces it needs, so a
checkpoint saved by any number of FSDP ranks loads at any other (one process included). The data position is
a global row count, so the run continues at the same row. RNG states are per rank: a rank that did not exist
at save time takes rank 0's.

Restarts: ``torchrun --max-restarts N`` (``MAX_RESTARTS`` of ``run_train.sh``) restarts every rank after a
failure, and the restarted ranks resume as above. Set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for such runs: with
the default shared rendezvous store the restarted ranks can read the previous attempt's addresses and fail to
connect (pytorch/pytorch#135712; here 2 of 3 gloo restarts failed without it, 0 of 3 with it).

The storage writer is a component (``storage_writer``, default DCP's ``FileSystemWriter``): the tests inject one
that kills its process mid-save; production code carries no fault injection.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import resource
import shutil
import time
import warnings
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from hola_titan.manifests import file_records, first_mismatch
from hola_titan.staging import error_chain, file_size_limit, write_text_atomic
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

logger = logging.getLogger("hola_titan")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HASH = "xxh3_64"
STEP_PREFIX = "step-"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint folder is partial or unreadable (missing or truncated files, bad metadata, a read error)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is readable but does not fit this model or run (other keys or shapes)."""


# ---------------------------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------------------------


def step_folder(folder: str | os.PathLike[str], step: int) -> Path:
    """``<folder>/step-<step>``."""
    return Path(folder) / f"{STEP_PREFIX}{step}"


def list_checkpoints(folder: str | os.PathLike[str]) -> list[int]:
    """Steps of the complete checkpoints in ``folder`` (``step-N`` folders holding ``.metadata``), ascending."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and (child / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The DCP metadata of a checkpoint folder after checking that every file it names is whole.

    Raises:
        CheckpointCorruptError: no ``.metadata``, metadata that does not unpickle, or a data file that is missing
            or shorter than the metadata says.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointCorruptError(f"checkpoint {path}: no such folder")
    if not (path / ".metadata").is_file():
        raise CheckpointCorruptError(f"checkpoint {path}: no .metadata file (partial checkpoint; a save was "
                                     "interrupted)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unpickling raises many types
        raise CheckpointCorruptError(f"checkpoint {path}: unreadable .metadata ({error!r})") from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {path}: data file {name} is missing")
        if file.stat().st_size < size:
            raise CheckpointCorruptError(f"checkpoint {path}: data file {name} is truncated "
                                         f"({file.stat().st_size} of {size} bytes)")
    return metadata


RUN_CONFIG = "config.toml"


def resolve_checkpoint(path: str | os.PathLike[str], *, safetensors: bool = False) -> tuple[Path, str | None]:
    """The checkpoint folder that ``path`` names, and how it was chosen (None when ``path`` is that folder).

    ``path`` may be a step folder (``<dump>/checkpoint/step-N``, holding ``.metadata``), a checkpoint folder
    (``<dump>/checkpoint``: its newest complete step) or a run folder (``<dump>``, holding ``config.toml``: the
    newest complete step of its ``checkpoint.folder``); with ``safetensors`` also an exported safetensors folder.
    Raises :class:`CheckpointError` in one line saying what ``path`` is and what to pass instead. The step found
    is checked no further here (:func:`read_metadata` and the manifest do that when it is read).
    """
    path = Path(path)
    forms = ("a step folder (<dump>/checkpoint/step-N, holding .metadata), a checkpoint folder (<dump>/checkpoint) "
             "or a run folder (<dump>, holding config.toml)" + (", or a safetensors export folder" if safetensors
                                                               else ""))
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder; pass {forms}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint; pass {forms}")
    if (path / ".metadata").is_file():
        return path, None
    if _is_safetensors_folder(path):
        if safetensors:
            return path, None
        raise CheckpointError(f"{path} is an exported safetensors folder, not a training checkpoint; pass {forms}")
    if _STEP_RE.match(path.name) or path.name.endswith(TMP_SUFFIX):
        raise CheckpointCorruptError(f"checkpoint {path}: no .metadata file (partial checkpoint; a save was "
                                     f"interrupted); pass a complete step, or its checkpoint folder {path.parent} "
                                     "for the newest complete one")
    folder, what = path, "checkpoint folder"
    if (path / RUN_CONFIG).is_file():
        from hola_titan.config import ConfigError, load_toml

        try:
            folder = path / load_toml(path / RUN_CONFIG).checkpoint.folder
        except (ConfigError, OSError):
            folder = path / "checkpoint"  # the default; an unreadable record is reported by whoever reads it
        what = "run folder"
    steps = list_checkpoints(folder)
    if steps:
        chosen = step_folder(folder, steps[-1])
        return chosen, f"step {steps[-1]}, the newest complete checkpoint of the {what} {path}"
    partial = sorted(p.name for p in folder.glob(f"{STEP_PREFIX}*")) if folder.is_dir() else []
    if what == "run folder":
        raise CheckpointError(f"{path} is a run folder with no complete checkpoint in {folder}"
                              f"{' (only partial: ' + ', '.join(partial) + ')' if partial else ''} (was the run "
                              f"started with --checkpoint.enable?); pass {forms}")
    if partial:
        raise CheckpointError(f"{path} holds no complete checkpoint (partial: {', '.join(partial)}); pass {forms}")
    raise CheckpointError(f"{path} is not a checkpoint (no .metadata, no step-N folders, no {RUN_CONFIG}); "
                          f"pass {forms}")


def _signature(folder: Path) -> tuple:
    """The names, sizes and modification times of the files of ``folder`` (its manifest aside, which a health
    record rewrites): what a cached verdict on the folder was reached on."""
    try:
        return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                            if f.is_file() and not f.name.startswith(MANIFEST)))
    except OSError:
        return ()


# A checkpoint's health, in its manifest: whether the model it saved is one to keep and export. Known only once a
# loss has been computed from its weights (the first loss after the save), so a fresh checkpoint is "unjudged".
HEALTHY, UNHEALTHY, UNJUDGED = "healthy", "unhealthy", "unjudged"


def write_manifest(folder: str | os.PathLike[str], *, health: str | None = None, why: str = "") -> Path:
    """Write ``<folder>/manifest.json``: the size and checksum of every file in the folder (atomically), and the
    saved model's health (``health``: :data:`HEALTHY`, :data:`UNHEALTHY` or :data:`UNJUDGED`; None: not recorded)
    with ``why``."""
    folder = Path(folder)
    files = file_records(folder, hash_name=HASH, key="digest", skip=lambda name: name.startswith(MANIFEST))
    record = {"hash": HASH, "files": files}
    if health is not None:
        record.update(_health_fields(health, why))
    _write_json_atomically(folder / MANIFEST, record)
    return folder / MANIFEST


def _health_fields(health: str, why: str) -> dict:
    if health not in (HEALTHY, UNHEALTHY, UNJUDGED):
        raise ValueError(f"health: expected {HEALTHY}, {UNHEALTHY} or {UNJUDGED}, got {health!r}")
    # "healthy" (a bool) is what manifests recorded before a step could be unjudged; kept for their readers.
    return {"health": health, "health_why": why, "healthy": health == HEALTHY}


def _write_json_atomically(path: Path, record: dict) -> None:
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def record_health(folder: str | os.PathLike[str], health: str, why: str) -> None:
    """Set the health in ``<folder>/manifest.json`` (temp file + rename: a crash leaves the old record or the new,
    never a torn one). The checksums are untouched: the manifest does not list itself."""
    path = Path(folder) / MANIFEST
    record = json.loads(path.read_text())
    record.update(_health_fields(health, why))
    _write_json_atomically(path, record)


def recorded_health(folder: str | os.PathLike[str]) -> tuple[str, str]:
    """``(health, why)`` that the manifest of the checkpoint ``folder`` records. A manifest from before health was
    recorded, or none at all, counts as :data:`HEALTHY` (nothing was judged then); one from before steps could be
    unjudged records a bool, judged by the loss of the saved step itself."""
    try:
        record = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return HEALTHY, "no health recorded"
    if not isinstance(record, dict):
        return HEALTHY, "no health recorded"
    if record.get("health") in (HEALTHY, UNHEALTHY, UNJUDGED):
        return record["health"], str(record.get("health_why", ""))
    if "healthy" in record:
        return (HEALTHY, "") if record["healthy"] else (UNHEALTHY, "its step failed the health checks")
    return HEALTHY, "no health recorded"


def recorded_healthy(folder: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint in ``folder`` is recorded healthy (:func:`recorded_health`; unjudged is not)."""
    return recorded_health(folder)[0] == HEALTHY


def verify_manifest(folder: str | os.PathLike[str], *, checksums: bool = True) -> dict | None:
    """Check every file of a checkpoint folder against its ``manifest.json``.

    Returns ``{"files", "bytes", "seconds"}`` when all match, None when the folder has no manifest (written before
    manifests existed). Raises :class:`CheckpointCorruptError` naming the folder and the first file that is
    missing, of another size or whose checksum differs, or when the manifest itself cannot be read.
    ``checksums=False`` checks the files and their sizes only (no read of their bytes): what retention asks of the
    folders it has not hashed, so that a save does not stall every rank while rank 0 reads old checkpoints.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return None
    begin = time.perf_counter()
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("hash") != HASH:
            raise ValueError(f"unknown hash {manifest.get('hash')!r}")
        files = {name: (int(entry["size"]), str(entry["digest"])) for name, entry in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointCorruptError(f"checkpoint {folder}: unreadable {MANIFEST} ({error})") from error
    wrong = first_mismatch(folder, files, hash_name=HASH, checksums=checksums)
    if wrong is not None:
        raise CheckpointCorruptError(f"checkpoint {folder}: {wrong.name} {wrong.describe(MANIFEST, 'the save')}")
    total = sum(size for size, _ in files.values())
    return {"files": len(files), "bytes": total, "seconds": time.perf_counter() - begin}


def recorded_config(path: str | os.PathLike[str]) -> str | None:
    """The resolved config (TOML text) that the run which wrote the checkpoint ``path`` recorded in it, or None
    for a checkpoint that records none (a model-only or seed checkpoint, or one from before it was recorded)."""
    path = Path(path)
    if "info.config" not in _keys(read_metadata(path)):
        return None
    info = {"config": ""}
    try:
        with _single_process_quiet():
            dcp.load({"info": info}, checkpoint_id=str(path), no_dist=True)
    except CheckpointException as error:
        raise CheckpointCorruptError(f"checkpoint {path}: its recorded config cannot be read "
                                     f"({_first_failure(error)})") from None
    return info["config"]


def _keys(metadata: Metadata) -> set[str]:
    return set(metadata.state_dict_metadata)


def is_model_only(metadata: Metadata) -> bool:
    """True for a checkpoint with weights but no training state (seed or imported checkpoint)."""
    return not any(key.startswith("train_state.") for key in _keys(metadata))


def _is_safetensors_folder(path: Path) -> bool:
    """An export folder: weights beside config.json, or an export whose weight file is gone (its load then says
    which file is missing, instead of calling the folder no checkpoint)."""
    from hola_titan.export import is_export

    return (path / "config.json").is_file() and (any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")) or is_export(path))


# ---------------------------------------------------------------------------------------------------------------
# Stateful parts
# ---------------------------------------------------------------------------------------------------------------


class ModelState:
    """The model's weights by FQN; FSDP-sharded parameters stay DTensors, so DCP reshards them on load."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerState:
    """The optimizer's state keyed by parameter FQN (layout-independent)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def rng_state() -> bytes:
    """This process's python, numpy, torch CPU and (when present) CUDA generator states, pickled."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    """Restore what :func:`rng_state` captured (CUDA states only where the device count matches)."""
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group, even when asked for exactly that (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---------------------------------------------------------------------------------------------------------------
# The checkpointer
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _PendingSave:
    step: int
    future: Future
    health: str = UNJUDGED
    why: str = ""


class Checkpointer:
    """Saves and restores one run's model, optimizer, schedule, data position, counters and RNG (module docstring).

    Args:
        folder: the checkpoint folder (``<dump_folder>/<checkpoint.folder>``).
        model, optimizer, lr_scheduler, dataloader, train_state: what is saved; the last three need
            ``state_dict()`` / ``load_state_dict()``.
        interval, keep_latest_k, async_mode, initial_load_path, load_step: the ``[checkpoint]`` settings.
        run_info: saved under ``info.*`` with every checkpoint (the trainer's resolved config, global batch and
            tokenizer fingerprint), read back as :attr:`loaded_info` by :meth:`load`.
        check_resume: called with the saved ``run_info`` of a checkpoint before its state is read; raises
            :class:`CheckpointMismatchError` to refuse the resume.
        storage_writer: the DCP writer class, called with a folder (tests inject one that fails mid-save).
    """

    def __init__(self, *, folder: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, train_state: Any, interval: int, keep_latest_k: int = 0,
                 async_mode: str = "disabled", initial_load_path: str | None = None, load_step: int = -1,
                 run_info: dict[str, Any] | None = None, check_resume: Any = None, allow_unverified: bool = False,
                 storage_writer: type[FileSystemWriter] = FileSystemWriter):
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode: expected 'disabled' or 'async', got {async_mode!r}")
        self.folder = Path(folder)
        self.model = model
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.initial_load_path = initial_load_path
        self.load_step = load_step
        self.run_info = dict(run_info or {})
        self.check_resume = check_resume
        self.allow_unverified = allow_unverified
        self.loaded_info: dict[str, Any] | None = None
        # Which weights the last load() started from: None (the model's own initialisation), or a dict with "kind"
        # ("resumed", "model_only" or "initial_load_path"), "path" and, when resumed, "step".
        self.started_from: dict[str, Any] | None = None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.states: dict[str, Any] = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
        }
        # Background saves talk over their own gloo group so that they never interleave with the training
        # collectives of the main thread.
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" and self.distributed else None
        self._pending: _PendingSave | None = None
        self.storage_writer = storage_writer
        # The step the last load() resumed from (retention keeps it), and rank 0's verdicts on step folders, keyed by
        # step, with the files' sizes and times they were reached on: each folder is hashed once per process.
        self.resumed_step: int | None = None
        self._verdicts: dict[int, tuple[tuple, str | None]] = {}
        self._reported: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ collective helpers

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _from_rank0(self, value: Any) -> Any:
        """``value`` as computed on rank 0, on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ saving

    def _save_state(self) -> dict[str, Any]:
        return {**self.states, "rng": {f"rank{self.rank}": rng_state()},
                "info": {"format": FORMAT_VERSION, "world_size": self.world_size, **self.run_info}}

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether :meth:`maybe_save` writes a checkpoint at ``step``."""
        return final or step % self.interval == 0

    def maybe_save(self, step: int, *, final: bool = False, health: str = UNJUDGED, why: str = "") -> bool:
        """Called after every step: finish a background save that is done, and save when ``step`` is due (returns
        whether it saved)."""
        self._poll_pending()
        if self.due(step, final=final):
            self.save(step, health=health, why=why)
            return True
        return False

    def save(self, step: int, *, health: str = UNJUDGED, why: str = "") -> Path:
        """Write the full training state of ``step`` to ``step-<step>`` (sync or async; module docstring).
        ``health``: what the manifest records of the saved model (:func:`write_manifest`); the trainer saves
        :data:`UNJUDGED` and judges the step with the next loss (:meth:`record_health`), which retention reads."""
        self._wait_pending()
        tmp = self.folder / f"{STEP_PREFIX}{step}{TMP_SUFFIX}"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        writer = self.storage_writer(str(tmp))
        begin = time.perf_counter()
        if self.async_mode == "async":
            with _single_process_quiet():
                future = dcp.async_save(self._save_state(), storage_writer=writer, process_group=self._async_group,
                                        no_dist=not self.distributed)
            self._pending = _PendingSave(step=step, future=future, health=health, why=why)
            logger.info("checkpoint: step %d staged in %.2f s; writing in the background to %s", step,
                        time.perf_counter() - begin, tmp)
            return step_folder(self.folder, step)
        with self._write_errors(tmp), _single_process_quiet():
            dcp.save(self._save_state(), storage_writer=writer, no_dist=not self.distributed)
        self._barrier()
        with self._write_errors(tmp):
            self._finalize(step, health=health, why=why)
        logger.info("checkpoint: saved step %d to %s in %.2f s", step, step_folder(self.folder, step),
                    time.perf_counter() - begin)
        return step_folder(self.folder, step)

    @contextmanager
    def _write_errors(self, tmp: Path):
        """A failed write (a full disk above all: DCP then reports only "unexpected pos ...") becomes one
        :class:`CheckpointError` naming the folder, the cause and the fix (for a full disk the free space, for the
        file size limit that limit); the partial folder is removed and the earlier checkpoints stay as they
        were."""
        try:
            yield
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException; torch.save raises many types
            free = shutil.disk_usage(self.folder if self.folder.exists() else self.folder.parent).free
            chain = error_chain(error)
            seen, errnos = [str(e) for e in chain], {getattr(e, "errno", None) for e in chain}
            short_write = any("unexpected pos" in text for text in seen)
            limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
            # A file that reaches the file size limit fails as a short write too, and DCP drops the errno (EFBIG):
            # with a limit set and room on the disk, that limit is what stopped it.
            too_large = (errno.EFBIG in errnos or any("File too large" in text for text in seen)
                         or (short_write and limited and free >= (64 << 20)))
            full = not too_large and (free < (64 << 20) or short_write or errno.ENOSPC in errnos
                                      or any("No space" in text for text in seen))
            shutil.rmtree(tmp, ignore_errors=True)
            if too_large:
                raise CheckpointError(
                    f"checkpoint: writing {tmp} failed (a file reached {file_size_limit()}); raise the limit "
                    f"(ulimit -f unlimited) or write checkpoints to a file system that takes larger files; the "
                    f"earlier checkpoints in {self.folder} are intact") from error
            what = "no space left on the device" if full else f"{type(error).__name__}: {str(error)[:200]}"
            raise CheckpointError(
                f"checkpoint: writing {tmp} failed ({what}; {free / 2**30:.2f} GiB free there); free space or set "
                f"job.dump_folder / checkpoint.folder elsewhere; the earlier checkpoints in {self.folder} are "
                "intact") from error

    def _poll_pending(self) -> None:
        """Rank 0 finalises a background save as soon as it is done (the other ranks only join it later)."""
        pending = self._pending
        if pending is not None and self.rank == 0 and pending.future.done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        begin = time.perf_counter()
        tmp = self.folder / f"{STEP_PREFIX}{pending.step}{TMP_SUFFIX}"
        with self._write_errors(tmp):
            pending.future.result()
            self._finalize(pending.step, health=pending.health, why=pending.why)
        logger.info("checkpoint: background save of step %d complete (waited %.2f s)", pending.step,
                    time.perf_counter() - begin)

    def _finalize(self, step: int, *, health: str = UNJUDGED, why: str = "") -> None:
        """Rank 0: rename ``step-N.tmp`` to ``step-N`` and drop old checkpoints beyond ``keep_latest_k``."""
        if self.rank != 0:
            return
        tmp, final = self.folder / f"{STEP_PREFIX}{step}{TMP_SUFFIX}", step_folder(self.folder, step)
        begin = time.perf_counter()
        write_manifest(tmp, health=health, why=why)
        logger.info("checkpoint: checksums of step %d written in %.2f s", step, time.perf_counter() - begin)
        if final.exists():
            # Move the old folder aside first, so that a crash here leaves the complete .tmp (promoted at the next
            # start) rather than nothing.
            logger.warning("checkpoint: replacing the existing %s", final)
            aside = final.with_name(final.name + OLD_SUFFIX)
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self._verdicts[step] = (_signature(final), None)  # its checksums were computed from these files just now
        try:
            self._retain(step)
        except (OSError, CheckpointError) as error:
            # The step is saved; an old folder that vanished or cannot be read while retention looks at it must not
            # turn that into a failed save.
            logger.warning("checkpoint: retention after step %d skipped (%s); the checkpoints are left as they are",
                           step, error)

    def record_health(self, step: int, health: str, why: str) -> None:
        """Rank 0: record the judged health of checkpoint ``step`` in its manifest, or in its background save when
        that is still being written (its manifest is written when it completes). A step judged before keeps its
        verdict."""
        if self.rank != 0:
            return
        pending = self._pending
        if pending is not None and pending.step == step:
            pending.health, pending.why = health, why
        else:
            path = step_folder(self.folder, step)
            if recorded_health(path)[0] != UNJUDGED:
                return  # judged already (by the run that wrote it): the first verdict, on the first loss, stands
            try:
                record_health(path, health, why)
            except (OSError, ValueError) as error:
                # Retention then treats the step as unjudged: never the newest healthy one, never exported by default.
                logger.warning("checkpoint: the health of %s could not be recorded (%s)", path, error)
                return
        log = logger.info if health == HEALTHY else logger.warning
        log("checkpoint: step %d judged %s: %s", step, health, why)

    def step_problem(self, step: int) -> str | None:
        """Rank 0: None when ``step-<step>`` verifies against its manifest, else why not (a folder without a
        manifest verifies only with ``allow_unverified``). A folder this process hashed (written, loaded, or refused
        at load) keeps that verdict while its files keep their sizes and times; any other is checked by its files
        and their sizes, not hashed: reading every kept checkpoint at the first save of a run would hold every rank
        at its next collective for minutes at 7B. Its bytes are checked where they are used, at load and by the
        converter."""
        path = step_folder(self.folder, step)
        signature = _signature(path)
        known = self._verdicts.get(step)
        if known is not None and known[0] == signature:
            return known[1]
        try:
            read_metadata(path)
            problem = None if verify_manifest(path, checksums=False) is not None or self.allow_unverified else (
                f"checkpoint {path}: no {MANIFEST}, so its bytes cannot be verified")
        except CheckpointCorruptError as error:
            problem = str(error)
        self._verdicts[step] = (signature, problem)
        return problem

    def _retain(self, written: int) -> None:
        """Drop verified checkpoints beyond the newest ``keep_latest_k`` ones, never ``written`` (just saved), the one
        this run resumed from, nor the newest one recorded healthy. A step folder that does not verify is not
        counted among the k and is left where it is, said once: it is evidence, and deleting it is the user's call."""
        if self.keep_latest_k <= 0:
            return
        steps = list_checkpoints(self.folder)
        verified, broken = [], []
        for step in reversed(steps):
            problem = self.step_problem(step)
            (broken if problem else verified).append((step, problem))
        verified_steps = [step for step, _ in verified]
        keep = set(verified_steps[:self.keep_latest_k]) | {written}
        why = {written: "just written"}
        if self.resumed_step in verified_steps:
            keep.add(self.resumed_step)
            why.setdefault(self.resumed_step, "this run resumed from it")
        newest_healthy = next((s for s in verified_steps if recorded_healthy(step_folder(self.folder, s))), None)
        if newest_healthy is not None:
            keep.add(newest_healthy)
            why.setdefault(newest_healthy, "the newest recorded healthy")
        for step, problem in broken:
            if (step, problem) not in self._reported:
                self._reported.add((step, problem))
                logger.warning("checkpoint: %s; not counted among keep_latest_k = %d and left in place for inspection "
                               "(remove it yourself once inspected)", problem, self.keep_latest_k)
        newest_k = set(verified_steps[:self.keep_latest_k])
        for step in sorted(keep - newest_k):
            logger.info("checkpoint: keeping %s beyond keep_latest_k = %d: %s", step_folder(self.folder, step),
                        self.keep_latest_k, why[step])
        for old in verified_steps:
            if old not in keep:
                shutil.rmtree(step_folder(self.folder, old), ignore_errors=True)
                self._verdicts.pop(old, None)
                logger.info("checkpoint: removed %s (keep_latest_k = %d)", step_folder(self.folder, old),
                            self.keep_latest_k)

    def close(self) -> None:
        """Wait for a background save and finalise it (every rank)."""
        self._wait_pending()
        self._barrier()

    def finish(self) -> None:
        """Wait for a background save and finalise it on this rank alone (no barrier: for a rank on its way out on
        an error, which the other ranks may not share)."""
        self._wait_pending()

    # ------------------------------------------------------------------ loading

    def load(self, *, resume: bool = True) -> int | None:
        """Restore the newest complete checkpoint (or ``load_step``), else the initial weights; see the module
        docstring. ``resume=False`` (``checkpoint.enable`` off): the folder is not looked at, only
        ``initial_load_path`` is loaded. Returns the step resumed from, or None for a start at step 0;
        :attr:`started_from` says which weights the run started from."""
        plan, self.started_from, self.resumed_step = None, None, None
        if self.rank == 0:
            try:
                plan = self._plan_load() if resume else self._plan_initial()
            except CheckpointError as error:
                plan = error
        plan = self._from_rank0(plan)
        if isinstance(plan, Exception):
            raise plan
        kind, payload = plan
        if kind == "fresh":
            if resume:
                logger.info("checkpoint: no checkpoint in %s; starting from step 0", self.folder)
            return None
        if kind == "initial":
            path, how = payload
            if how is not None:
                logger.info("checkpoint: initial_load_path %s: using %s", self.initial_load_path, how)
            self._load_model_only(Path(path), what="initial_load_path")
            self.started_from = {"kind": "initial_load_path", "path": str(path), "given": self.initial_load_path}
            return None
        if self.initial_load_path and self.load_step == -1:
            logger.info("checkpoint: initial_load_path %s not used: %s has checkpoints of this run, which resume it",
                        self.initial_load_path, self.folder)
        failures = []
        for step, problem in payload:
            path = step_folder(self.folder, step)
            if problem is None:
                problem = self._verify(path)
                if problem is None and self.rank == 0:
                    self._verdicts[step] = (_signature(path), None)  # retention need not hash it again
            if problem is None:
                try:
                    return self._load_step(step, path)
                except CheckpointCorruptError as error:
                    problem = str(error)
                except CheckpointException as error:
                    problem = f"checkpoint {path}: read error ({_first_failure(error)})"
            if self.rank == 0:
                self._verdicts[step] = (_signature(path), problem)  # retention does not count it, nor re-checks it
            failures.append(problem)
            if self.load_step != -1:
                raise CheckpointCorruptError(problem)
            logger.error("checkpoint: %s; falling back to the previous complete checkpoint", problem)
        raise CheckpointCorruptError(f"no loadable checkpoint in {self.folder}: " + "; ".join(failures))

    def _verify(self, path: Path) -> str | None:
        """Rank 0 checks ``path`` against its manifest (one read); every rank gets the verdict: None or the
        problem."""
        verdict = None
        if self.rank == 0:
            try:
                checked = verify_manifest(path)
            except CheckpointCorruptError as error:
                verdict = str(error)
            else:
                if checked is None and not self.allow_unverified:
                    verdict = (f"checkpoint {path}: no {MANIFEST}, so its bytes cannot be verified (written before "
                               "checksums existed, or the file was removed); set checkpoint.allow_unverified = true "
                               "to load it anyway")
                elif checked is None:
                    logger.warning("checkpoint: %s has no %s (written before checksums existed): its bytes are not "
                                   "verified (checkpoint.allow_unverified)", path, MANIFEST)
                else:
                    logger.info("checkpoint: %s verified (%d files, %.2f GB in %.2f s)", path, checked["files"],
                                checked["bytes"] / 1e9, checked["seconds"])
        return self._from_rank0(verdict)

    def _plan_load(self) -> tuple[str, Any] | Exception:
        """Rank 0: what to load, as ``("fresh", None)``, ``("initial", path)`` or ``("steps", [(step, problem)])``
        newest first, where ``problem`` is None or why the folder cannot be read."""
        if self.folder.is_dir():
            for stale in self.folder.glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"):
                final = stale.with_name(stale.name[:-len(TMP_SUFFIX)])
                try:
                    # DCP writes .metadata last, once every rank's files are written: a .tmp that passes this check
                    # is a finished save whose rename was cut short (a background save, or a crash in _finalize).
                    read_metadata(stale)
                    complete = not final.exists()
                except CheckpointCorruptError:
                    complete = False
                if complete:
                    logger.warning("checkpoint: %s is complete but was not renamed; promoting it to %s", stale, final)
                    if not (stale / MANIFEST).is_file():
                        write_manifest(stale)  # the save finished; the checksums were still to be written
                    os.replace(stale, final)
                else:
                    logger.warning("checkpoint: removing %s, left by a save that did not complete", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            for old in self.folder.glob(f"{STEP_PREFIX}*{OLD_SUFFIX}"):
                shutil.rmtree(old, ignore_errors=True)
        steps = list_checkpoints(self.folder)
        if self.folder.is_dir():
            # A step folder without .metadata is no checkpoint to list_checkpoints; say so rather than skip it quietly.
            for child in sorted(self.folder.iterdir()):
                if _STEP_RE.match(child.name) and child.is_dir() and not (child / ".metadata").is_file():
                    logger.error("checkpoint: %s has no .metadata file (damaged, or a copy that lost it): it cannot be "
                                 "loaded and is skipped", child)
        if self.load_step != -1:
            if not step_folder(self.folder, self.load_step).is_dir():
                return CheckpointError(f"checkpoint.load_step: {step_folder(self.folder, self.load_step)} does not "
                                       f"exist; complete checkpoints in {self.folder}: {steps or 'none'}")
            steps = [self.load_step]
        elif not steps:
            return self._plan_initial()
        checked = []
        for step in reversed(steps):
            try:
                read_metadata(step_folder(self.folder, step))
                checked.append((step, None))
            except CheckpointCorruptError as error:
                checked.append((step, str(error)))
        return ("steps", checked)

    def _plan_initial(self) -> tuple[str, Any]:
        """Rank 0: ``("initial", (folder, how it was chosen or None))`` for ``initial_load_path``, else
        ``("fresh", None)``; raises :class:`CheckpointError` naming the key when the path names no checkpoint."""
        if not self.initial_load_path:
            return ("fresh", None)
        try:
            return ("initial", resolve_checkpoint(self.initial_load_path, safetensors=True))
        except CheckpointCorruptError as error:
            raise CheckpointCorruptError(f"checkpoint.initial_load_path: {error}") from None
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint.initial_load_path: {error}") from None

    def _check_fits(self, metadata: Metadata, path: Path) -> None:
        """Raise :class:`CheckpointMismatchError` when the checkpoint's weights are not this model's."""
        saved = {key[len("model."):]: meta for key, meta in metadata.state_dict_metadata.items()
                 if key.startswith("model.")}
        ours = get_model_state_dict(self.model)
        missing = sorted(set(ours) - set(saved))
        unexpected = sorted(set(saved) - set(ours))
        shapes = [f"{k} {list(saved[k].size)} vs {list(v.shape)}" for k, v in ours.items()
                  if k in saved and isinstance(saved[k], TensorStorageMetadata) and tuple(saved[k].size) != v.shape]
        if missing or unexpected or shapes:
            named = self._model_keys_that_differ(path)
            if named:
                raise CheckpointMismatchError(
                    f"checkpoint {path} was written by a run with another model: {named}; set it back, or load a "
                    "checkpoint of this model (a new run goes in another job.dump_folder)")
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this model (another flavour, size or vocabulary?): missing "
                f"{missing[:4]}, unexpected {unexpected[:4]}, other shapes {shapes[:4]}")

    def _model_keys_that_differ(self, path: Path) -> str | None:
        """``model.flavour: 'hola' there, 'gdn' now; ...`` from the config the checkpoint recorded (the model keys
        that change the weights' names or shapes), or None when it recorded none or they agree."""
        ours = self.run_info.get("config")
        if not ours:
            return None
        try:
            theirs = recorded_config(path)
        except CheckpointError:
            return None
        if not theirs:
            return None
        from hola_titan.config import config_from_text, flat_items
        try:
            old = flat_items(config_from_text(theirs, source=f"the config recorded in {path}"))
            new = flat_items(config_from_text(ours, source="this run's config"))
        except ValueError:
            return None
        keys = ("model.flavour", "model.size", "model.vocab_size", "model.n_layers")
        differ = [f"{k}: {old[k]!r} there, {new[k]!r} now" for k in keys if old.get(k) != new.get(k)]
        return "; ".join(differ) or None

    def _load_step(self, step: int, path: Path) -> int | None:
        metadata = read_metadata(path)
        self._check_fits(metadata, path)
        if is_model_only(metadata):
            self._load_model_only(path, what=f"model-only checkpoint step {step}", metadata=metadata, verified=True)
            self.started_from = {"kind": "model_only", "path": str(path)}
            return None
        keys = _keys(metadata)
        state = dict(self.states)
        train_state = self.states["train_state"]
        for name in ("train_state", "dataloader"):
            saved = {k.split(".", 1)[1] for k in keys if k.startswith(name + ".")}
            if set(self.states[name].state_dict()) - saved:
                # A checkpoint from before a field existed: load the fields it has; the part's load_state_dict
                # decides what a missing one means.
                state[name] = _Subset(self.states[name], saved)
        own = f"rng.rank{self.rank}"
        rng_key = own if own in keys else ("rng.rank0" if "rng.rank0" in keys else None)
        if rng_key is not None:
            state["rng"] = {rng_key.split(".", 1)[1]: b""}
        info = {"format": 0, "world_size": 0}
        if "info.world_size" in keys:
            state["info"] = info
        saved_info = None
        if self.run_info and all(f"info.{k}" in keys for k in self.run_info):
            saved_info = {k: type(v)() if v is not None else None for k, v in self.run_info.items()}
            with _single_process_quiet():
                dcp.load({"info": saved_info}, checkpoint_id=str(path), no_dist=not self.distributed)
        elif self.run_info:
            logger.warning("checkpoint: %s does not record its run's settings (an earlier version wrote it): settings "
                           "changed since cannot be checked", path)
        if saved_info is not None and self.check_resume is not None:
            self.check_resume(saved_info, path)
        self.loaded_info = saved_info
        begin = time.perf_counter()
        try:
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=str(path), no_dist=not self.distributed)
        except ValueError as error:  # a part's load_state_dict refused the saved state (e.g. the data loader's)
            raise CheckpointMismatchError(f"checkpoint {path} does not fit this run: {error}") from error
        if rng_key is not None:
            set_rng_state(state["rng"][rng_key.split(".", 1)[1]])
            if rng_key != own:
                logger.info("checkpoint: %s not in %s; using rank 0's RNG state", own, path)
        saved_world = state.get("info", info)["world_size"]
        logger.info("checkpoint: resuming from step %d (%s, saved by %s process(es), loaded by %d, in %.2f s)",
                    train_state.step, path, saved_world or "?", self.world_size, time.perf_counter() - begin)
        if train_state.step != step:
            logger.warning("checkpoint: %s holds step %d", path, train_state.step)
        self.started_from = {"kind": "resumed", "path": str(path), "step": train_state.step}
        self.resumed_step = step
        return train_state.step

    def _load_model_only(self, path: Path, *, what: str, metadata: Metadata | None = None,
                         verified: bool = False) -> None:
        """Weights only, from a DCP folder (full or model-only) or a safetensors export folder; step stays 0."""
        begin = time.perf_counter()
        if _is_safetensors_folder(path):
            from hola_titan.export import ExportCorruptError, check_keys, read_safetensors, verify_export

            # Rank 0 checks the export's manifest (sha256; none: a warning, as load_pretrained gives) and every rank
            # gets the verdict: one read of the files for the whole job, not one per rank.
            verdict = None
            if self.rank == 0:
                try:
                    verify_export(path)
                except ExportCorruptError as error:
                    verdict = f"export {path}: {error}"
            verdict = self._from_rank0(verdict)
            if verdict is not None:
                raise CheckpointCorruptError(verdict)
            try:
                full = read_safetensors(path)
            except ExportCorruptError as error:
                raise CheckpointCorruptError(f"export {path}: {error}") from None
            check_keys(set(get_model_state_dict(self.model)), set(full), source=str(path))
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=True))
        else:
            metadata = metadata or read_metadata(path)
            self._check_fits(metadata, path)
            problem = None if verified else self._verify(path)
            if problem is not None:
                raise CheckpointCorruptError(problem)
            with _single_process_quiet():
                dcp.load({"model": self.states["model"]}, checkpoint_id=str(path), no_dist=not self.distributed)
        logger.info("checkpoint: weights from %s %s (model only; optimizer, schedule and data start fresh at step "
                    "0) in %.2f s", what, path, time.perf_counter() - begin)


class _Subset:
    """A stateful object seen through the keys a checkpoint has (DCP refuses keys the checkpoint lacks)."""

    def __init__(self, inner: Any, keys: set[str]):
        self.inner, self.keys = inner, keys

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.inner.state_dict().items() if k in self.keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _first_failure(error: BaseException) -> str:
    failures = getattr(error, "_failures", None) or {}
    for rank, failure in failures.items():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {exc!r}"
    return repr(error)


# ---------------------------------------------------------------------------------------------------------------
# Model-only checkpoints: seed, plain state dicts
# ---------------------------------------------------------------------------------------------------------------


def save_model_only(state_dict: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """Write a model-only DCP checkpoint (keys ``model.<fqn>``) from one process, atomically (``.tmp`` + rename).

    The result loads as ``checkpoint.initial_load_path`` or, named ``step-0`` in a checkpoint folder, as the start
    of a run.
    """
    path = Path(path)
    if path.exists() or path.is_symlink():
        # Never replaced: it may be the start of runs already trained from it, or not ours at all.
        raise CheckpointError(f"{path} exists; it is left as it is: remove it yourself or choose another folder")
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)  # an earlier save_model_only of this path cut short: the .tmp name is this writer's own
    tmp.mkdir(parents=True)
    write_model_only(state_dict, tmp)
    os.replace(tmp, path)
    return path


def write_model_only(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike[str]) -> None:
    """The files of a model-only checkpoint (DCP files, then ``manifest.json``) in the existing empty ``folder``,
    in place: the caller renames the folder into place when this returns (:func:`save_model_only`,
    ``scripts/import_safetensors.py``)."""
    with _single_process_quiet():
        dcp.save({"model": state_dict, "info": {"format": FORMAT_VERSION, "world_size": 1}},
                 storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    write_manifest(folder)


def load_model_state(path: str | os.PathLike[str], model: nn.Module, *, progress: bool = False,
                     allow_unverified: bool = False, verified: bool = False) -> None:
    """Load the ``model.*`` weights of any checkpoint folder into a plain (unsharded) model, in one process.

    The folder's files are checked against its manifest first (:func:`verify_manifest`, raising
    :class:`CheckpointCorruptError` naming the file); a folder without one is refused as training refuses it, unless
    ``allow_unverified`` (then a warning). Loads layer by layer (a tqdm bar with ``progress``) so peak memory stays
    one model. ``verified``: the caller checked the folder against its manifest just now (the converter, choosing
    among steps), so its bytes are not read twice.
    """
    path = Path(path)
    metadata = read_metadata(path)
    if not verified and verify_manifest(path) is None:
        if not allow_unverified:
            raise CheckpointCorruptError(f"checkpoint {path}: no {MANIFEST}, so its bytes cannot be verified (written "
                                         "before checksums existed, or the manifest was removed); pass "
                                         "--allow-unverified to convert it anyway")
        logger.warning("checkpoint: %s has no %s (written before checksums existed): its bytes are not verified",
                       path, MANIFEST)
    saved = {key[len("model."):] for key in metadata.state_dict_metadata if key.startswith("model.")}
    state = model.state_dict()
    if set(state) != saved:
        raise CheckpointMismatchError(f"checkpoint {path} does not fit the model of the run's config: missing "
                                      f"{sorted(set(state) - saved)[:4]}, unexpected {sorted(saved - set(state))[:4]}")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        group = ".".join(key.split(".")[:2]) if key.startswith("layers.") else key
        groups.setdefault(group, {})[key] = tensor
    items = groups.values()
    if progress:
        from tqdm import tqdm

        items = tqdm(list(items), desc=f"reading {path.name}", unit="part")
    with _single_process_quiet():
        for part in items:
            dcp.load({"model": part}, checkpoint_id=str(path), no_dist=True)


def create_seed_checkpoint(config: Any) -> Path:
    """Initialise the model of ``config`` (a ``JobConfig``) exactly as the trainer does and save its weights as
    ``<dump_folder>/<checkpoint.folder>/step-0`` (model only). Every layout that starts from it starts identically.
    The command is ``python -m hola_titan.seed``."""
    from hola_titan.builder import model_args_of
    from hola_titan.models.model import build_model

    args, _ = model_args_of(config)
    torch.manual_seed(config.training.seed)
    model = build_model(args, device="cpu", backend=config.model.attention_backend)
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    held = list_checkpoints(folder)
    if held:
        # A seed starts a fresh run: written beside a run's checkpoints it would never be loaded (a resume takes the
        # newest step), and step-0 of a run that trained from it is never replaced.
        raise CheckpointError(f"{folder} already holds checkpoints (steps {', '.join(map(str, held))}); a seed "
                              "checkpoint starts a fresh run: choose another job.dump_folder")
    path = step_folder(folder, 0)
    save_model_only(model.state_dict(), path)
    logger.info("checkpoint: seed checkpoint written to %s", path)
    return path
