"""The typed job config: one schema of nested dataclasses, loaded from defaults, a TOML file and the command line.

Precedence, lowest first:

1. the defaults written in the dataclasses below;
2. the TOML file named by ``--job.config_file PATH`` (tables are sections: ``[training]`` then ``steps = 100``);
3. command-line overrides ``--section.key value`` or ``--section.key=value``. A boolean flag alone
   (``--compile.enable``) means true; ``--compile.enable false`` turns it off. Lists and tuples are
   comma-separated (``--optimizer.betas 0.9,0.95``); ``none`` sets an optional field to None.

``--dry-run`` is a launch flag, not a config key: :func:`parse_config` stores it on ``JobConfig.dry_run``, which
is never read from or written to TOML, and the launcher decides what it does. ``--help`` prints every key.

Every mistake raises :class:`ConfigError` (a ``ValueError``) whose one-line message starts with the key, e.g.
``training.seq_len: expected int, got 'abc'``. :func:`parse_config` checks each field on its own (types,
choices, ranges); :func:`validate` adds the checks that need the world size or the model's shape and runs
before any model is built. :func:`write_resolved` writes the final config into the run folder as TOML that
:func:`load_toml` reads back to an equal config.

To add a field: add an annotated attribute with a default and a docstring to its section class. Supported
types are ``bool``, ``int``, ``float``, ``str``, ``Literal[...]`` of strings, ``list[str]``, ``tuple`` of fixed
length, and ``X | None`` (whose default must be None, because TOML has no null and None is written by leaving
the key out). Put a numeric bound in ``_MINIMUM`` and a cross-field rule in :func:`validate`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence, Union, get_args, get_origin, get_type_hints

from hola_titan.models import flavours
from hola_titan.models.args import model_args

# The registry's flavours (hola_titan/models/flavours.py) are the config's choices.
FlavourName = Literal[tuple(flavours.FLAVOURS)]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUNDLED = "bundled"
"""The value of ``model.tokenizer_path`` and ``data.dataset`` that selects what ships with the package."""


class ConfigError(ValueError):
    """A config mistake; ``key`` is the dotted key (or flag) it concerns and starts the one-line message."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(" ".join(f"{key}: {problem}".split()))


# ---------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = None
    """The TOML file the config was read from (set by ``--job.config_file``)."""
    dump_folder: str = "./outputs"
    """Run folder: the resolved config, checkpoints and TensorBoard logs go under it."""
    description: str = ""
    """Free text shown in logs."""
    cache_folder: str = "~/.cache/hola_titan"
    """Per-node cache shared by runs: the verdict of fla's #640 gradient check per GPU, head dim and versions, so
    that a second process does not repeat it. Empty: keep nothing (every process runs the check)."""


@dataclass
class Model:
    flavour: FlavourName = "hola"
    """Token mixer of every block: HOLA (score eviction), HOLA+recency, GDN (cache off) or Transformer++."""
    size: Literal["debug", "small", "340M", "1.3B", "7B"] = "debug"
    """Widths and depth (``hola_titan.models.args``); the vocabulary size comes from the tokenizer."""
    tokenizer_path: str = BUNDLED
    """``bundled`` (``hola_titan/assets/tokenizer``) or a folder or ``tokenizer.json`` of a HF tokenizer."""
    vocab_size: int | None = None
    """The vocabulary size; None: the tokenizer's. When set, training checks it against the tokenizer (an error
    names both), and ``--dry-run`` uses it when the tokenizer is not on disk (a dry run needs no data)."""
    window: int | None = None
    """Override of the HOLA cache size in tokens (recurrent flavours); None keeps the size's value."""
    block: int | None = None
    """Override of the block (chunk) length in tokens (recurrent flavours); None keeps the size's value."""
    n_layers: int | None = None
    """Override of the number of blocks (a shallow model of a size's width, for tests and ablations)."""
    attention_backend: Literal["auto", "reference", "sdpa", "triton"] = "auto"
    """Token-mixer implementation: ``auto`` picks the fastest available for flavour and device, ``reference`` is
    pure PyTorch, ``sdpa`` PyTorch scaled-dot-product attention, ``triton`` the Triton kernels."""
    overlap_backward: bool = False
    """HOLA layers on the Triton backend (CUDA): run each layer as one op whose backward overlaps the cache
    attention's backward (a side CUDA stream) with fla's GDN backward. Same results bit for bit; 0.3-0.9 ms faster
    per layer call at the 340M shape on an H200, not yet measured in whole-model training."""
    require_fast_path: bool = False
    """Refuse to start when ``attention_backend = auto`` on a GPU cannot use the Triton kernels (it falls back to
    the reference backend then, with a warning that says why)."""
    kernels: Literal["auto", "triton", "reference"] = "auto"
    """The rest of the step: the fused q|k|v short convolution and the head's cross-entropy. ``triton``: this
    project's Triton kernels (``kernels/short_conv.py``, ``kernels/cross_entropy.py``; CUDA); ``reference``: the
    PyTorch forms they are tested against; ``auto``: ``triton`` on CUDA, ``reference`` elsewhere. The run's log
    names what ran (``paths``)."""
    kernel_configs: str = "auto"
    """Launch configurations of fla-core's autotuned kernels (``kernels/tuned_configs.py``): ``auto`` takes the
    file shipped for this GPU and these fla-core and Triton versions (``kernels/configs/``) when there is one, else
    autotunes (the log says which); ``off`` autotunes every kernel at its first launch (minutes on a fresh
    machine); or the path of a file written by ``scripts/tune_kernels.py``."""
    precompile_workers: int = -1
    """Worker processes that compile this run's Triton kernels side by side before the first launch, from the plan
    that the kernel configurations file holds for this kind of run (``kernels/precompile.py``; CUDA, recurrent
    flavours): -1 chooses (half the CPU cores shared by the node's processes, at most 8), 0 compiles each kernel
    at its first launch instead. Workers of several runs on one node compile each kernel once."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = 4e-4
    """Peak learning rate."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1, beta2."""
    fused: bool | None = None
    """Use the fused AdamW kernel; None: fused where the device supports it."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup from 0 to ``optimizer.lr`` over this many steps."""
    decay_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warmup, over the remaining ``training.steps``."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of the peak (0 to 1)."""


@dataclass
class Training:
    steps: int = 10_000
    """Optimizer steps to train for."""
    seq_len: int = 2048
    """Tokens per row."""
    local_batch_size: int = 8
    """Rows per micro-batch on one data-parallel rank."""
    global_batch_size: int | None = None
    """Rows per optimizer step over all ranks; None or -1: ``local_batch_size`` x data-parallel degree. A larger
    multiple of that product accumulates gradients over several micro-batches."""
    max_norm: float = 1.0
    """Gradient clipping by total norm; 0 turns clipping off."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of parameters in forward and backward (FSDP mixed precision); the optimizer keeps float32 copies."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks."""
    seed: int = 0
    """Seed of parameter init and data order."""
    deterministic: bool = False
    """Use deterministic algorithms (slower); for parallel-equals-serial comparisons."""
    skip_nan_inf: bool = False
    """Skip (and log) an optimizer step whose loss or gradient norm is NaN or inf, or whose loss spikes (see
    ``loss_spike_factor``), instead of stopping the run."""
    max_consecutive_skips: int = 10
    """With ``skip_nan_inf``: stop the run once this many consecutive steps were skipped (a run that skips every
    step is diverging, not recovering)."""
    loss_spike_factor: float = 4.0
    """Treat a step as failed (stop, or skip with ``skip_nan_inf``) when its loss exceeds this factor times the
    running mean (exponential, decay 0.9) of the accepted steps' losses; checked from step
    ``loss_spike_warmup + 1`` on, before the optimizer update. 0 turns the guard off."""
    loss_spike_warmup: int = 20
    """Accepted steps before the loss-spike guard starts (the running mean settles first)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available, else CPU."""
    loss_chunk_size: int = 0
    """Rows (tokens) per chunk of the chunked output-head cross-entropy, used without tensor parallelism; 0: auto
    (about 256 MiB of float32 logits per chunk)."""
    gc_freq: int = 50
    """Collect Python garbage (generation 1) every this many steps, with automatic collection off while training:
    an automatic collection pauses one rank at a random step and every rank waits for it at the next collective
    (torchtitan does the same). 0 leaves Python's automatic collection on."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP (sharded data parallel) degree; -1 fills the ranks the other degrees leave."""
    data_parallel_replicate_degree: int = 1
    """Replicated data-parallel degree (HSDP when both data-parallel degrees exceed 1)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree; must divide the number of heads."""
    context_parallel_degree: int = 1
    """Context (sequence) parallel degree; rows are split into this many contiguous pieces."""
    fsdp_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, every block (full) or per ``selective_ac_option``."""
    selective_ac_option: str = "2"
    """With ``selective``: ``op`` (save the outputs of expensive ops) or a positive integer N as a string
    (checkpoint every N-th block)."""


@dataclass
class Compile:
    enable: bool = False
    """``torch.compile`` each block."""
    fullgraph: bool = True
    """Require each compiled block to be one graph (fail on graph breaks)."""


@dataclass
class Float8:
    enable: bool = False
    """Train linear layers in float8 (torchao); needs a CUDA device with compute capability 8.9 or newer."""
    recipe: Literal["tensorwise", "rowwise"] = "rowwise"
    """torchao float8 scaling recipe."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers that stay in high precision: those whose fully qualified name is one of these or ends with
    ``.<entry>`` (``output`` keeps an untied head, ``attn.o_proj`` every block's output projection)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints and resume from the latest one in ``folder``."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to ``job.dump_folder``."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the latest k checkpoints; 0 keeps all."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """``async`` saves in a background thread while training continues."""
    allow_unverified: bool = False
    """Resume from a checkpoint that has no ``manifest.json`` (its checksums; written before they existed, or
    removed since), whose bytes therefore cannot be verified. False: such a checkpoint is refused by name and the
    previous verified one is tried."""
    initial_load_path: str | None = None
    """Weights to start from (weights only, at step 0): a checkpoint step folder, a checkpoint or run folder (its
    newest complete step) or a safetensors export folder. Loaded whether or not ``enable`` is set; with ``enable``
    only while ``folder`` holds no checkpoint of this run (a resume wins). The log and ``paths.json`` say which
    weights the run started from."""
    load_step: int = -1
    """Step to resume from; -1: the latest."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of exported model weights."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log loss, throughput and memory every this many steps."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to ``job.dump_folder``."""


@dataclass
class Profiling:
    enable: bool = False
    """Record ``torch.profiler`` traces of training steps on every rank."""
    freq: int = 100
    """Trace one step in every this many: the last of each window, after ``warmup`` traced-and-dropped steps."""
    warmup: int = 2
    """Steps recorded before each traced one and dropped (the profiler's own start-up)."""
    traces_folder: str = "profile_traces"
    """Relative to ``job.dump_folder``: ``step-N/rank{R}.json.gz`` (a Chrome trace; Perfetto opens it) and
    ``step-N/rank{R}.txt`` (the operators with the most self time, on the device where there is one)."""


@dataclass
class Validation:
    enable: bool = False
    """Measure validation loss during training."""
    freq: int = 500
    """Validate every this many steps."""
    steps: int = 20
    """Batches per validation."""
    dataset: str | None = None
    """Validation data (same forms as ``data.dataset``); None: the held-out split of the training data."""


@dataclass
class Data:
    dataset: str = BUNDLED
    """``bundled``, a Hugging Face hub name, or local ``.jsonl``/``.parquet``/``.txt`` files (file, folder or
    glob)."""
    dataset_config: str | None = None
    """Hub dataset configuration (subset) name."""
    split: str = "train"
    """Split to train on."""
    text_field: str = "text"
    """Column that holds the document text."""
    streaming: bool | None = None
    """Stream instead of downloading; None: true for hub names, false for local files."""
    varlen: bool = True
    """Pack documents into rows with document boundaries (no attention or state across documents); false:
    plain concatenation, every row one causal sequence."""
    holdout_every: int = 100
    """Local data without ``train``/``validation`` sub-folders (one file, a glob, a plain folder): every N-th
    document in reading order is held out for validation and never trained on. 0: no hold-out (validation on
    such data is then refused: it would read training documents). Bundled and hub data have their own splits."""
    allow_changed_data: bool = False
    """Resume even when the training data differs from what the checkpoint's run read (its fingerprint: per file
    the size and the bytes at both ends; hub data by name), with a warning. False: such a resume is refused in one
    line naming the files, since it would continue at a row of another document stream."""


@dataclass
class JobConfig:
    """The whole config: one attribute per section, plus the ``--dry-run`` launch flag."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    data: Data = field(default_factory=Data)
    dry_run: bool = False
    """Set by ``--dry-run``; not a config key, never in TOML."""


def _sections() -> dict[str, type]:
    """Section name -> section class, in schema order."""
    hints = get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig) if dataclasses.is_dataclass(hints[f.name])}


SECTIONS: dict[str, type] = _sections()

# Lower bounds of numeric fields; None (where a field allows it) always passes.
_MINIMUM: dict[str, float] = {
    "model.window": 0,
    "model.block": 1,
    "model.n_layers": 1,
    "model.precompile_workers": -1,
    "model.vocab_size": 1,
    "optimizer.weight_decay": 0,
    "lr_scheduler.warmup_steps": 0,
    "lr_scheduler.min_lr_factor": 0,
    "training.steps": 1,
    "training.seq_len": 1,
    "training.local_batch_size": 1,
    "training.max_norm": 0,
    "training.gc_freq": 0,
    "training.max_consecutive_skips": 1,
    "training.loss_spike_factor": 0,
    "training.loss_spike_warmup": 0,
    "profiling.freq": 1,
    "profiling.warmup": 0,
    "training.seed": 0,
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1,
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "checkpoint.load_step": -1,
    "metrics.log_freq": 1,
    "validation.freq": 1,
    "validation.steps": 1,
    "data.holdout_every": 0,
}
_POSITIVE = ("optimizer.lr", "optimizer.eps")


# ---------------------------------------------------------------------------------------------------------------
# Values: type checks and coercion
# ---------------------------------------------------------------------------------------------------------------


def _type_name(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or none"
    if origin is Literal:
        return "one of " + ", ".join(args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is tuple:
        return f"{len(args)} values of {_type_name(args[0])}"
    return hint.__name__


def _coerce(key: str, hint: Any, value: Any, *, text: bool) -> Any:
    """``value`` as type ``hint``; ``text`` says it is a command-line string rather than a TOML value."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        if value is None or (text and value.strip().lower() in ("", "none", "null")):
            return None
        return _coerce(key, inner, value, text=text)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"expected one of {', '.join(args)}; got {value!r}")
        return value
    if origin in (list, tuple):
        items = ([] if not value.strip() else [v.strip() for v in value.split(",")]) if text else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(key, f"expected {_type_name(hint)}, got {value!r}")
        if origin is tuple:
            if len(items) != len(args):
                raise ConfigError(key, f"expected {_type_name(hint)}, got {len(items)} values: {value!r}")
            return tuple(_coerce(key, a, v, text=text) for a, v in zip(args, items))
        return [_coerce(key, args[0], v, text=text) for v in items]
    if hint is bool:
        if text and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.strip().lower() in ("true", "1", "yes", "on")
        if not text and isinstance(value, bool):
            return value
    elif hint is int:
        if text:
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = value
        if text:
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if not math.isfinite(number):
                raise ConfigError(key, f"expected a finite float, got {value!r}")
            return float(number)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema type this module does not handle
        raise TypeError(f"{key}: unsupported config type {hint!r}")
    raise ConfigError(key, f"expected {_type_name(hint)}, got {value!r}")


def _field_hints(section: str) -> dict[str, Any]:
    return get_type_hints(SECTIONS[section])


def _split_key(key: str) -> tuple[str, str]:
    """``section.name`` -> (section, name), or a ConfigError naming the key."""
    section, dot, name = key.partition(".")
    if not dot or section not in SECTIONS:
        raise ConfigError(key, f"unknown config section {section!r}; sections are {', '.join(SECTIONS)}")
    hints = _field_hints(section)
    if name not in hints:
        raise ConfigError(key, f"unknown key; {section} has {', '.join(hints)}")
    return section, name


def _set(config: JobConfig, key: str, value: Any, *, text: bool) -> None:
    section, name = _split_key(key)
    setattr(getattr(config, section), name, _coerce(key, _field_hints(section)[name], value, text=text))


def _get(config: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def check_fields(config: JobConfig) -> None:
    """Check every field on its own: type, choices, bounds. Raises :class:`ConfigError`."""
    for section in SECTIONS:
        for name, hint in _field_hints(section).items():
            key = f"{section}.{name}"
            _coerce(key, hint, _get(config, key), text=False)
    for key, minimum in _MINIMUM.items():
        value = _get(config, key)
        if value is not None and value < minimum:
            raise ConfigError(key, f"must be >= {minimum}, got {value}")
    for key in _POSITIVE:
        if _get(config, key) <= 0:
            raise ConfigError(key, f"must be > 0, got {_get(config, key)}")
    if not all(0 <= beta < 1 for beta in config.optimizer.betas):
        raise ConfigError("optimizer.betas", f"each beta must be in [0, 1), got {config.optimizer.betas}")
    if config.lr_scheduler.min_lr_factor > 1:
        raise ConfigError("lr_scheduler.min_lr_factor", f"must be <= 1, got {config.lr_scheduler.min_lr_factor}")
    global_batch_size = config.training.global_batch_size
    if global_batch_size is not None and global_batch_size != -1 and global_batch_size < 1:
        raise ConfigError("training.global_batch_size", f"must be >= 1 or -1, got {global_batch_size}")
    shard = config.parallelism.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ConfigError("parallelism.data_parallel_shard_degree", f"must be >= 1 or -1, got {shard}")
    option = config.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option",
                          f"expected 'op' or a positive integer as a string, got {option!r}")


# ---------------------------------------------------------------------------------------------------------------
# Loading: TOML and command line
# ---------------------------------------------------------------------------------------------------------------


def _apply_toml(config: JobConfig, path: str) -> None:
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("job.config_file", f"no such file {path!r}") from None
    except IsADirectoryError:
        raise ConfigError("job.config_file", f"{path!r} is a folder, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("job.config_file", f"cannot parse TOML file {path!r}: {e}") from None
    for section, table in tables.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown config section in {path!r}; sections are {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a [{section}] table in {path!r}, got {table!r}")
        for name, value in table.items():
            try:
                _set(config, f"{section}.{name}", value, text=False)
            except ConfigError as e:
                raise ConfigError(e.key, f"{str(e).removeprefix(e.key + ': ')} (in {path!r})") from None


def config_from_text(text: str, *, source: str) -> JobConfig:
    """The config of TOML ``text`` over the defaults (e.g. the resolved config a checkpoint carries); keys this
    version does not know are skipped, so an older run's record still reads."""
    config = JobConfig()
    for section, table in tomllib.loads(text).items():
        if section not in SECTIONS or not isinstance(table, dict):
            continue
        for name, value in table.items():
            try:
                _set(config, f"{section}.{name}", value, text=False)
            except ConfigError as e:
                if "unknown" not in str(e):
                    raise ConfigError(e.key, f"{str(e).removeprefix(e.key + ': ')} (in {source})") from None
    return config


def flat_items(config: JobConfig) -> dict[str, Any]:
    """``{"section.key": value}`` of every config key."""
    return {f"{section}.{name}": value for section, table in to_dict(config).items() for name, value in table.items()}


def load_toml(path: str | os.PathLike[str]) -> JobConfig:
    """The config of a TOML file over the defaults, with no command line (e.g. a resolved ``config.toml``)."""
    config = JobConfig()
    _apply_toml(config, os.fspath(path))
    check_fields(config)
    return config


def _parse_argv(argv: Sequence[str]) -> tuple[list[tuple[str, str | None]], bool]:
    """Command-line tokens -> ([(dotted key, raw value or None)], dry_run)."""
    overrides: list[tuple[str, str | None]] = []
    dry_run = False
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--dry-run":
            dry_run = True
            continue
        if not token.startswith("--") or "." not in token.partition("=")[0]:
            raise ConfigError(token, "unknown argument; config keys are given as --section.key value")
        key, eq, value = token[2:].partition("=")
        if eq:
            overrides.append((key, value))
        elif i < len(argv) and not argv[i].startswith("--"):
            overrides.append((key, argv[i]))
            i += 1
        else:
            overrides.append((key, None))
    return overrides, dry_run


def parse_config(argv: Sequence[str]) -> JobConfig:
    """The config of a command line (without the program name): defaults < ``--job.config_file`` < overrides.

    Checks every field on its own (:func:`check_fields`); call :func:`validate` once the world size is known.
    ``--help`` prints every key with its default and doc and exits.
    """
    if "--help" in argv or "-h" in argv:
        print(format_help())
        raise SystemExit(0)
    overrides, dry_run = _parse_argv(argv)
    config = JobConfig(dry_run=dry_run)
    config_files = [value for key, value in overrides if key == "job.config_file" and value is not None]
    if config_files:
        _apply_toml(config, config_files[-1])
    for key, value in overrides:
        section, name = _split_key(key)
        if value is None:
            if _field_hints(section)[name] is not bool:
                raise ConfigError(key, "missing value")
            value = "true"
        _set(config, key, value, text=True)
    check_fields(config)
    return config


# ---------------------------------------------------------------------------------------------------------------
# Cross-field checks
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelDegrees:
    """Parallel degrees with ``data_parallel_shard_degree = -1`` filled in, and the batch they imply."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    global_batch_size: int
    """Rows per optimizer step over all ranks."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct micro-batches per step."""
        return self.dp_replicate * self.dp_shard


def resolve_degrees(parallelism: Parallelism, training: Training, *, world_size: int) -> ParallelDegrees:
    """Fill ``data_parallel_shard_degree = -1``, check that the degrees multiply to ``world_size``, and derive
    the global batch and gradient-accumulation steps. Raises :class:`ConfigError`."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rep, tp, cp = (parallelism.data_parallel_replicate_degree, parallelism.tensor_parallel_degree,
                   parallelism.context_parallel_degree)
    shard = parallelism.data_parallel_shard_degree
    others = rep * tp * cp
    if shard == -1:
        if world_size % others:
            # The shard degree is filled in automatically: the keys at fault are the degrees that were set.
            key = next((k for k, v in (("parallelism.tensor_parallel_degree", tp),
                                       ("parallelism.context_parallel_degree", cp),
                                       ("parallelism.data_parallel_replicate_degree", rep)) if v > 1),
                       "parallelism.tensor_parallel_degree")
            raise ConfigError(key, f"replicate {rep} x tensor {tp} x context {cp} = {others} does not divide the "
                              f"{world_size} processes of this run")
        shard = world_size // others
    if shard * others != world_size:
        raise ConfigError("parallelism.data_parallel_shard_degree",
                          f"replicate {rep} x shard {shard} x tensor {tp} x context {cp} = {shard * others}, but the "
                          f"world size is {world_size} (-1 fills the ranks left)")
    micro_rows = training.local_batch_size * rep * shard
    global_batch_size = training.global_batch_size
    if global_batch_size is None or global_batch_size == -1:
        global_batch_size = micro_rows
    if global_batch_size % micro_rows:
        raise ConfigError("training.global_batch_size",
                          f"{global_batch_size} is not a multiple of local_batch_size {training.local_batch_size} "
                          f"x data-parallel degree {rep * shard} = {micro_rows}")
    return ParallelDegrees(dp_replicate=rep, dp_shard=shard, tp=tp, cp=cp, global_batch_size=global_batch_size,
                           grad_accum_steps=global_batch_size // micro_rows)


def schedule_warning(config: JobConfig) -> str | None:
    """The warning for a warmup that does not end before the run does (None otherwise). Not an error: short runs
    of the long recipes (``--training.steps 10`` on a 1024-step warmup) and the tests do this on purpose."""
    warmup, steps = config.lr_scheduler.warmup_steps, config.training.steps
    if warmup < steps:
        return None
    peak = steps / (warmup + 1)  # the factor of the last step, train.lr_lambda(steps - 1)
    return (f"lr_scheduler.warmup_steps {warmup} >= training.steps {steps}: the learning rate is still warming up "
            f"when the run ends (at most {peak:.0%} of optimizer.lr, no decay); set lr_scheduler.warmup_steps below "
            "training.steps for the whole schedule")


def _runs_on_cuda(device: str) -> bool:
    """Whether ``training.device`` resolves to CUDA here (as the trainer resolves it)."""
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    import torch

    return torch.cuda.is_available()


def check_compile_fullgraph(config: JobConfig, *, backend: str, where: str) -> None:
    """Refuse ``compile.fullgraph`` for a recurrent flavour whose token mixer runs on the reference backend
    (``where``: the device and why). Raises :class:`ConfigError` naming both compile keys and the device.

    ``hola_attention_reference`` is wrapped in ``torch.compiler.disable``: Inductor compiles it to wrong gradients
    (docs/LOG.md, 2026-11-29), so a compiled block breaks its graph around it, which ``fullgraph`` forbids; only the
    Triton backend's custom ops compile into one graph.
    """
    if not (config.compile.enable and config.compile.fullgraph) or backend != "reference":
        return
    raise ConfigError("compile.fullgraph", f"true with compile.enable cannot compile a {config.model.flavour} block "
                      f"on {where}: its token mixer runs on the PyTorch reference backend there, which stays out of "
                      "torch.compile (Inductor computes its gradients wrongly: docs/LOG.md, 2026-11-29), a graph "
                      "break in every block; set --compile.fullgraph false (the rest of each block is still "
                      "compiled) or leave compile.enable off")


def validate(config: JobConfig, *, world_size: int) -> None:
    """Checks across fields that must pass before any model is built. Raises :class:`ConfigError`.

    The GPU's float8 support is checked later, at runtime; here float8 only requires ``training.device cuda``.
    """
    check_fields(config)
    degrees = resolve_degrees(config.parallelism, config.training, world_size=world_size)
    model = config.model
    try:
        args = model_args(model.flavour, model.size, vocab_size=1, window=model.window, block=model.block,
                          n_layers=model.n_layers)
    except ValueError as e:
        key, _, problem = str(e).partition(": ")
        raise ConfigError(key, problem) from None
    if args.n_heads % degrees.tp:
        raise ConfigError("parallelism.tensor_parallel_degree",
                          f"{degrees.tp} does not divide the {args.n_heads} heads of {model.flavour} {model.size}")
    seq_len = config.training.seq_len
    if args.is_recurrent and seq_len % args.block:
        raise ConfigError("training.seq_len", f"{seq_len} is not a multiple of block {args.block}")
    if degrees.cp > 1 and seq_len % degrees.cp:
        raise ConfigError("training.seq_len", f"{seq_len} is not a multiple of context_parallel_degree {degrees.cp}")
    if args.is_recurrent and degrees.cp > 1 and seq_len // degrees.cp < args.conv_size - 1:
        # A shard may end inside a block (the next rank continues it), but the convolution tails come from the
        # previous shard alone.
        raise ConfigError("training.seq_len", f"{seq_len} over context_parallel_degree {degrees.cp} leaves shards of "
                          f"{seq_len // degrees.cp} tokens, fewer than conv_size - 1 = {args.conv_size - 1}")
    if not args.is_recurrent and degrees.cp > 1:
        if config.data.varlen:
            raise ConfigError("data.varlen", "must be false for transformer with context_parallel_degree > 1")
    if degrees.cp > 1 and config.compile.enable and config.compile.fullgraph:
        # The context-parallel hooks read the batch layout in Python and send and receive: they run eagerly between
        # the compiled parts of a block, i.e. a graph break each.
        raise ConfigError("compile.fullgraph", "must be false with context_parallel_degree > 1 (the handover of "
                          "state and cache between ranks runs eagerly between the compiled parts of each block)")
    if config.compile.enable and config.compile.fullgraph and args.is_recurrent:
        # What can be known before the model is built: an explicit reference backend, or auto on a machine without
        # CUDA. (auto on a GPU without fla-core also falls back to the reference: the trainer checks that once it
        # has resolved the backend.)
        backend, device = model.attention_backend, config.training.device
        on_cuda = _runs_on_cuda(device)
        if backend == "reference":
            where = f"{'cuda' if on_cuda else 'cpu'} (model.attention_backend reference)"
            check_compile_fullgraph(config, backend="reference", where=where)
        elif backend == "auto" and not on_cuda:
            where = f"cpu (training.device {device}{'' if device == 'cpu' else ', no CUDA device'})"
            check_compile_fullgraph(config, backend="reference", where=where)
    if config.profiling.enable and config.profiling.freq <= config.profiling.warmup:
        raise ConfigError("profiling.freq", f"must exceed profiling.warmup = {config.profiling.warmup} (each window "
                          f"is warmup steps, then the traced one), got {config.profiling.freq}")
    if config.float8.enable and config.training.device != "cuda":
        raise ConfigError("float8.enable", f"needs training.device cuda, got {config.training.device!r}")


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` of every config key (None included, tuples as lists; no ``dry_run``)."""
    return {
        section: {name: list(v) if isinstance(v, (list, tuple)) else v
                  for name, v in dataclasses.asdict(getattr(config, section)).items()}
        for section in SECTIONS
    }


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(_TOML_ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                          for c in value)
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(config: JobConfig) -> str:
    """The config as TOML text; None values are left out (every optional field defaults to None)."""
    lines = ["# Resolved hola-titan config (defaults < TOML file < command line); load with config.load_toml."]
    for section, table in to_dict(config).items():
        lines += ["", f"[{section}]"]
        lines += [f"{name} = {_toml_value(value)}" for name, value in table.items() if value is not None]
    return "\n".join(lines) + "\n"


def write_resolved(config: JobConfig, folder: str | os.PathLike[str], *,
                   resolved: dict[str, str] | None = None) -> Path:
    """Write ``<folder>/config.toml`` (creating the folder) and return its path; ``resolved`` (what the run
    decided at start, e.g. the attention backend an ``auto`` chose) is appended as comments."""
    path = Path(folder) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = to_toml(config)
    if resolved:
        text += "\n# Resolved at start (not settings):\n" + "".join(f"# {k}: {v}\n" for k, v in resolved.items())
    path.write_text(text, encoding="utf-8")
    return path


def field_docs() -> dict[str, str]:
    """``{"section.key": docstring}`` read from this module's source (attribute docstrings)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    except (OSError, TypeError):  # pragma: no cover - source not shipped
        return {}
    section_of = {cls.__name__: name for name, cls in SECTIONS.items()}
    docs: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in section_of:
            continue
        for stmt, following in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[f"{section_of[node.name]}.{stmt.target.id}"] = " ".join(following.value.value.split())
    return docs


def format_help() -> str:
    """Every config key with its type, default and doc, for ``--help``."""
    docs = field_docs()
    defaults = to_dict(JobConfig())
    lines = ["Options: --job.config_file PATH, --section.key VALUE (overrides the TOML file), --dry-run."]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for name, hint in _field_hints(section).items():
            key = f"{section}.{name}"
            lines.append(f"  --{key} ({_type_name(hint)}; default {defaults[section][name]!r})")
            lines.append(f"      {docs.get(key, '')}")
    return "\n".join(lines)
