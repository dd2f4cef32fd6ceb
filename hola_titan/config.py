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

To add a field: add an annotated attribute to its section class whose default is a :func:`setting` (the default,
the field's resume class and its numeric bounds), followed by a docstring. Supported types are ``bool``, ``int``,
``float``, ``str``, ``Literal[...]`` of strings, ``list[str]``, ``tuple`` of fixed length, and ``X | None`` (whose
default must be None, because TOML has no null and None is written by leaving the key out). Put a cross-field rule
in :func:`validate`.

The parser is this module's, not tyro's (torchtitan's): tyro takes ``--no-flag`` and space-separated lists and
reports mistakes in a multi-line panel, not the forms above and the one-line ``error: key: problem`` (exit 2).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import operator
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple, Sequence, Union, get_args, get_origin, get_type_hints

from hola_titan.models import flavours
from hola_titan.models.args import ModelArgs, model_args

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


Resume = Literal["fixed", "schedule", "applied", "launch"]
"""What a resumed run does with a key whose value differs from its checkpoint's (``hola_titan/resume.py``):
``fixed`` refuses the resume, ``schedule`` applies the new value to the optimizer and the schedule from the resume
step, ``applied`` takes it as given, ``launch`` does not compare it (it says how to start, not what to train)."""

_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def setting(default: Any, *, resume: Resume, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, also: int | None = None) -> Any:
    """A config field: its ``default``, its resume class and the bounds :func:`check_fields` enforces (``ge`` >=,
    ``gt`` >, ``le`` <=, ``lt`` <; on every item of a tuple; None passes; ``also``: one more accepted value, -1
    for "fill in"), kept in the field's metadata, from which the resume rules and the checks are derived."""
    if resume not in get_args(Resume):
        raise TypeError(f"resume class {resume!r} is none of {', '.join(get_args(Resume))}")
    bounds = {name: bound for name, bound in zip(_BOUNDS, (ge, gt, le, lt)) if bound is not None}
    metadata = {"resume": resume, **bounds}
    if also is not None:
        metadata["also"] = also
    if isinstance(default, list):  # dataclasses refuse a shared mutable default: every config gets its own list
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = setting(None, resume="launch")
    """The TOML file the config was read from (set by ``--job.config_file``)."""
    dump_folder: str = setting("./outputs", resume="launch")
    """Run folder: the resolved config, checkpoints and TensorBoard logs go under it."""
    description: str = setting("", resume="applied")
    """Free text shown in logs."""
    cache_folder: str = setting("~/.cache/hola_titan", resume="launch")
    """Per-node cache shared by runs: the verdict of fla's #640 gradient check per GPU, head dim and versions, so
    that a second process does not repeat it, the tokenised data (``data.token_cache``), the content hashes of the
    data files (``data_hashes``: the data's fingerprint that a resume compares), and the kernel configurations fla
    autotuned where no shipped table served them (``model.kernel_configs = auto``). Empty: keep nothing (every
    process runs the check, hashes the data files, tokenises and autotunes)."""


@dataclass
class Model:
    flavour: FlavourName = setting("hola", resume="fixed")
    """Token mixer of every block: HOLA (score eviction), HOLA+recency, GDN (cache off) or Transformer++."""
    size: Literal["debug", "small", "46M", "340M", "1.3B", "7B"] = setting("debug", resume="fixed")
    """Widths and depth (``hola_titan.models.args``); the vocabulary size comes from the tokenizer."""
    tokenizer_path: str = setting(BUNDLED, resume="launch")
    """``bundled`` (``hola_titan/assets/tokenizer``) or a folder or ``tokenizer.json`` of a HF tokenizer."""
    vocab_size: int | None = setting(None, resume="fixed", ge=1)
    """The vocabulary size; None: the tokenizer's. When set, training checks it against the tokenizer (an error
    names both), and ``--dry-run`` uses it when the tokenizer is not on disk (a dry run needs no data)."""
    window: int | None = setting(None, resume="fixed", ge=0)
    """Override of the HOLA cache size in tokens (recurrent flavours); None keeps the size's value."""
    block: int | None = setting(None, resume="fixed", ge=1)
    """Override of the block (chunk) length in tokens (recurrent flavours); None keeps the size's value."""
    n_layers: int | None = setting(None, resume="fixed", ge=1)
    """Override of the number of blocks (a shallow model of a size's width, for tests and ablations)."""
    state_read_scale: Literal["inv_sqrt_head_dim", "one"] = setting("inv_sqrt_head_dim", resume="fixed")
    """Recurrent flavours: the factor s of the state read ``o_state = s S^T q`` (q unit-norm). ``inv_sqrt_head_dim``:
    s = D^-1/2, fla's default for GDN; ``one``: s = 1, the state read as the paper's Eq. 1 and 3 write it (q^T S).
    HOLA adds the cache read before the per-head output norm, so s sets the weight of the state against the cache:
    at D = 256, D^-1/2 makes the state read 16x smaller than the paper's (docs/DESIGN.md §1, docs/LOG.md)."""
    gate_init: float | None = setting(None, resume="fixed")
    """HOLA flavours: the cache gate's logit at init (lambda = sigmoid(gate)); None: -4, the paper's value."""
    cache_sink: bool = setting(True, resume="fixed")
    """HOLA flavours: the null sink of the cache read (a learned logit per head whose value is zero, in every
    query's softmax denominator; the paper's). ``false``, an ablation: the read is a plain softmax over the cache
    entries and the block's tokens (each query sees at least itself, so no row is empty). The ``sink`` parameters
    stay in the model, unused, so checkpoints and exports keep their keys; the ``paths`` line says "no sink"."""
    cache_mix: Literal["before_norm", "after_norm", "per_path_norm"] = setting("before_norm", resume="fixed")
    """HOLA flavours: where the cache read joins the state read, with o_norm the per-head output RMSNorm and
    lambda = sigmoid(gate): ``before_norm`` o_norm(o_state + lambda o_cache); ``after_norm`` o_norm(o_state) +
    lambda o_cache; ``per_path_norm`` o_norm(o_state) + lambda o_norm(o_cache) (one norm weight for both). The last
    two run the layered backward (the overlapped layer op fuses the sum)."""
    attention_backend: Literal["auto", "reference", "sdpa", "triton", "fa4"] = setting("auto", resume="applied")
    """Token-mixer implementation: ``auto`` picks the fastest available for flavour and device, ``reference`` is
    pure PyTorch, ``sdpa`` PyTorch scaled-dot-product attention, ``triton`` the Triton kernels, ``fa4`` the Triton
    backend's state path and selection with the cache read as one FlashAttention-4 varlen call (an sm_90 GPU with
    ``pip install 'hola-titan[fa4]'``; refused elsewhere, naming why; never ``auto``'s choice until it is measured
    faster end to end). The run's ``paths`` line says which ran."""
    overlap_backward: bool | None = setting(None, resume="applied")
    """HOLA layers on the Triton backend (CUDA): run each layer as one op whose backward overlaps the cache
    attention's backward (a side CUDA stream) with fla's GDN backward. Same results bit for bit (20 training steps
    of hola_340M: every loss equal), about 1% faster 340M training on an H200 for about 0.2 GiB more peak memory
    (docs/LOG.md, 2026-12-04). ``None`` (default): on, unless ``save_cache_output`` is (the two are different
    backward ops); ``true`` / ``false``: on / off. It applies to fresh calls at head dims fla runs unpadded;
    context-parallel shards and padded head dims run the layered form. The run's ``paths`` line says which ran."""
    save_cache_output: bool = setting(False, resume="applied")
    """HOLA layers on the Triton backend: keep each layer's cache-read output (one ``[tokens, heads, head_dim]``
    tensor in the compute dtype per layer, about 1.5 GiB at 340M with 32,768 tokens per step) for the backward,
    which then takes the softmax gradient's row sums (delta) from it. At head dim 256 the dk/dv programs then also
    sum dq, by atomic float32 adds in no fixed order (5 products per (query, key) pair instead of 8; 11% faster
    cache backward on an H200), unless ``training.deterministic`` is on; at other head dims the dq pass computes
    three products with one ``[rows, head_dim]`` accumulator instead of four with two. Needs
    ``attention_backend`` resolving to ``triton`` and a flavour with a HOLA cache; not with ``overlap_backward``
    true (left unset, that gives way to this); context-parallel shards that continue a document form delta over the
    keys as before. The shipped compile plans do not cover its kernels yet (they compile at the first step). The
    same function (delta reads the stored output, rounded to the compute dtype); the run's ``paths`` line says which
    form ran."""
    cache_kernels: Literal["auto", "triton"] = setting("auto", resume="applied")
    """Which kernels run a HOLA layer's cache read on the Triton backend. ``auto``: the Gluon kernels (Hopper's
    warpgroup MMA, ``hola_titan/kernels/hola/gluon_kernels.py``) for fresh calls at head dim 256 in bf16/fp16 on an
    sm_90 GPU with Triton 3.6-3.9, the Triton kernels everywhere else; ``triton``: the Triton kernels always (to
    compare the two, e.g. with ``scripts/compare_losses.py``; the shipped compile plans list the kernels ``auto``
    runs, so the other ones compile at their first launch). The run's ``paths`` lines (``cache_forward``,
    ``cache_backward``) name the kernels and why. Refused for flavours without a HOLA cache and off the Triton
    backend."""
    require_fast_path: bool = setting(False, resume="applied")
    """Refuse to start when ``attention_backend = auto`` on a GPU cannot use the Triton kernels (it falls back to
    the reference backend then, with a warning that says why)."""
    kernels: Literal["auto", "triton", "reference"] = setting("auto", resume="applied")
    """The rest of the step: the fused q|k|v short convolution and the head's cross-entropy. ``triton``: this
    project's Triton kernels (``hola_titan/kernels/fused/short_conv.py``, ``hola_titan/kernels/fused/cross_entropy.py``;
    CUDA); ``reference``: the PyTorch forms they are tested against; ``auto``: ``triton`` on CUDA, ``reference``
    elsewhere. The run's log names what ran (``paths``)."""
    kernel_configs: str = setting("auto", resume="launch")
    """Launch configurations of fla-core's autotuned kernels (``hola_titan/kernels/runtime/tuned_configs.py``): ``auto``
    takes the file shipped for this GPU and these fla-core and Triton versions (``hola_titan/kernels/runtime/configs/``)
    when there is one, else autotunes (the log says which); ``off`` autotunes every kernel at its first launch (minutes
    on a fresh machine); or the path of a file written by ``scripts/tune_kernels.py``."""
    precompile_workers: int = setting(-1, resume="applied", ge=-1)
    """Worker threads that compile this run's Triton kernels side by side before the first launch, from the plan
    that the kernel configurations file holds for this kind of run (``hola_titan/kernels/runtime/precompile.py``; CUDA,
    recurrent flavours): -1 chooses (half the CPU cores shared by the node's processes, at most 8), 0 compiles each
    kernel at its first launch instead. Workers of several runs on one node compile each kernel once."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = setting("AdamW", resume="applied")
    """Optimizer class."""
    lr: float = setting(4e-4, resume="schedule", gt=0)
    """Peak learning rate."""
    eps: float = setting(1e-8, resume="schedule", gt=0)
    """Adam epsilon."""
    weight_decay: float = setting(0.01, resume="schedule", ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = setting((0.9, 0.95), resume="schedule", ge=0, lt=1)
    """Adam beta1, beta2."""
    fused: bool | None = setting(None, resume="applied")
    """Use the fused AdamW kernel; None: fused where the device supports it."""
    decay_cache_scalars: bool = setting(True, resume="fixed")
    """HOLA flavours: apply ``weight_decay`` to the cache's own parameters (``gamma_q``, ``gamma_k``, ``sink``,
    ``gate``, per layer), as to every other weight but GDN's ``A_log`` and ``dt_bias``. Off: they never decay
    (decay pulls the gate towards 0, i.e. lambda towards 1/2, and the RMSNorm-gamma sharpening towards 0)."""
    cache_lr_multiplier: float = setting(1.0, resume="fixed", gt=0)
    """HOLA flavours: the cache's own parameters (``gamma_q``, ``gamma_k``, ``sink``, ``gate``) learn at this
    multiple of the learning rate (schedule included); other than 1, they form a parameter group of their own."""


@dataclass
class LRScheduler:
    warmup_steps: int = setting(200, resume="schedule", ge=0)
    """Linear warmup from 0 to ``optimizer.lr`` over this many steps."""
    decay_type: Literal["cosine", "linear", "constant"] = setting("cosine", resume="schedule")
    """Shape of the decay after warmup, over the remaining ``training.steps``."""
    min_lr_factor: float = setting(0.1, resume="schedule", ge=0, le=1)
    """Final learning rate as a fraction of the peak (0 to 1)."""


@dataclass
class Training:
    steps: int = setting(10_000, resume="schedule", ge=1)
    """Optimizer steps to train for."""
    seq_len: int = setting(2048, resume="fixed", ge=1)
    """Tokens per row."""
    local_batch_size: int = setting(8, resume="applied", ge=1)
    """Rows per micro-batch on one data-parallel rank."""
    global_batch_size: int | None = setting(None, resume="applied", ge=1, also=-1)
    """Rows per optimizer step over all ranks; None or -1: ``local_batch_size`` x data-parallel degree. A larger
    multiple of that product accumulates gradients over several micro-batches."""
    max_norm: float = setting(1.0, resume="applied", ge=0)
    """Gradient clipping by total norm; 0 turns clipping off."""
    mixed_precision_param: Literal["bfloat16", "float32"] = setting("bfloat16", resume="applied")
    """Dtype of parameters in forward and backward (FSDP mixed precision); the optimizer keeps float32 copies."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = setting("float32", resume="applied")
    """Dtype of gradient reduction across data-parallel ranks."""
    seed: int = setting(0, resume="fixed", ge=0)
    """Seed of parameter init and data order."""
    deterministic: bool = setting(False, resume="applied")
    """Use deterministic algorithms (slower); for parallel-equals-serial comparisons."""
    skip_nan_inf: bool = setting(False, resume="applied")
    """Skip (and log) an optimizer step whose loss or gradient norm is NaN or inf, or whose loss spikes (see
    ``loss_spike_factor``), instead of stopping the run."""
    max_consecutive_skips: int = setting(10, resume="applied", ge=1)
    """With ``skip_nan_inf``: stop the run once this many consecutive steps were skipped (a run that skips every
    step is diverging, not recovering)."""
    loss_spike_factor: float = setting(4.0, resume="applied", ge=0)
    """Treat a step as failed (stop, or skip with ``skip_nan_inf``) when its loss exceeds this factor times the
    running mean (exponential, decay 0.9) of the accepted steps' losses; checked from step
    ``loss_spike_warmup + 1`` on, before the optimizer update. 0 turns the guard off."""
    loss_spike_warmup: int = setting(20, resume="applied", ge=0)
    """Accepted steps before the loss-spike guard starts (the running mean settles first)."""
    device: Literal["auto", "cpu", "cuda"] = setting("auto", resume="applied")
    """``auto``: CUDA when available, else CPU."""
    loss_chunk_size: int = setting(0, resume="applied", ge=0)
    """Rows (tokens) per chunk of the chunked output-head cross-entropy, used without tensor parallelism (refused
    with it); 0: auto (about 256 MiB of float32 logits per chunk). At most the tokens of a rank's micro-batch."""
    gc_freq: int = setting(50, resume="applied", ge=0)
    """Collect Python garbage (generation 1) every this many steps, with automatic collection off while training:
    an automatic collection pauses one rank at a random step and every rank waits for it at the next collective
    (torchtitan does the same). 0 leaves Python's automatic collection on."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = setting(-1, resume="applied", ge=1, also=-1)
    """FSDP (sharded data parallel) degree; -1 fills the ranks the other degrees leave."""
    data_parallel_replicate_degree: int = setting(1, resume="applied", ge=1)
    """Replicated data-parallel degree (HSDP when both data-parallel degrees exceed 1)."""
    tensor_parallel_degree: int = setting(1, resume="applied", ge=1)
    """Tensor-parallel degree; must divide the number of heads."""
    context_parallel_degree: int = setting(1, resume="applied", ge=1)
    """Context (sequence) parallel degree; rows are split into this many contiguous pieces."""
    fsdp_cpu_offload: bool = setting(False, resume="applied")
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = setting("none", resume="applied")
    """Recompute activations in backward: none, every block (full) or per ``selective_ac_option``."""
    selective_ac_option: str = setting("2", resume="applied")
    """With ``selective``: ``op`` (save the outputs of expensive ops) or a positive integer N as a string
    (checkpoint every N-th block)."""


@dataclass
class Compile:
    enable: bool = setting(False, resume="applied")
    """``torch.compile`` each block."""
    fullgraph: bool = setting(True, resume="applied")
    """Require each compiled block to be one graph (fail on graph breaks)."""


@dataclass
class Float8:
    enable: bool = setting(False, resume="applied")
    """Train linear layers in float8 (torchao); needs a CUDA device with compute capability 8.9 or newer."""
    recipe: Literal["tensorwise", "rowwise"] = setting("rowwise", resume="applied")
    """torchao float8 scaling recipe."""
    filter_fqns: list[str] = setting(["output"], resume="applied")
    """Linear layers that stay in high precision: those whose fully qualified name is one of these or ends with
    ``.<entry>`` (``output`` keeps an untied head, ``attn.o_proj`` every block's output projection)."""


@dataclass
class Checkpoint:
    enable: bool = setting(False, resume="applied")
    """Save distributed checkpoints and resume from the latest one in ``folder``."""
    folder: str = setting("checkpoint", resume="applied")
    """Checkpoint folder, relative to ``job.dump_folder``."""
    interval: int = setting(500, resume="applied", ge=1)
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = setting(0, resume="applied", ge=0)
    """Keep only the latest k checkpoints that verify; 0 keeps all. Also kept: the one just written, the one the run
    resumed from and the newest recorded healthy; folders that do not verify are left in place, not counted."""
    async_mode: Literal["disabled", "async"] = setting("disabled", resume="applied")
    """``async`` saves in a background thread while training continues."""
    allow_unverified: bool = setting(False, resume="launch")
    """Resume from a checkpoint that has no ``manifest.json`` (its checksums; written before they existed, or
    removed since), whose bytes therefore cannot be verified. False: such a checkpoint is refused by name and the
    previous verified one is tried."""
    initial_load_path: str | None = setting(None, resume="launch")
    """Weights to start from (weights only, at step 0): a checkpoint step folder, a checkpoint or run folder (its
    newest complete step) or a safetensors export folder. Loaded whether or not ``enable`` is set; with ``enable``
    only while ``folder`` holds no checkpoint of this run (a resume wins). The log and ``paths.json`` say which
    weights the run started from."""
    allow_folder_change: bool = setting(False, resume="launch")
    """Resume with a ``folder`` other than the one the run folder's ``config.toml`` records while that one still
    holds checkpoints. False: such a start is refused naming both folders (it would start at step 0 beside the
    run's checkpoints)."""
    load_step: int = setting(-1, resume="launch", ge=-1)
    """Step to resume from; -1: the latest."""
    export_dtype: Literal["float32", "bfloat16"] = setting("float32", resume="applied")
    """Dtype of exported model weights."""


@dataclass
class Metrics:
    log_freq: int = setting(10, resume="applied", ge=1)
    """Log loss, throughput and memory every this many steps."""
    enable_tensorboard: bool = setting(False, resume="applied")
    """Write TensorBoard event files."""
    save_tb_folder: str = setting("tb", resume="applied")
    """TensorBoard folder, relative to ``job.dump_folder``."""


@dataclass
class Profiling:
    enable: bool = setting(False, resume="applied")
    """Record ``torch.profiler`` traces of training steps on every rank."""
    freq: int = setting(100, resume="applied", ge=1)
    """Trace one step in every this many: the last of each window, after ``warmup`` traced-and-dropped steps."""
    warmup: int = setting(2, resume="applied", ge=0)
    """Steps recorded before each traced one and dropped (the profiler's own start-up)."""
    traces_folder: str = setting("profile_traces", resume="applied")
    """Relative to ``job.dump_folder``: ``step-N/rank{R}.json.gz`` (a Chrome trace; Perfetto opens it) and
    ``step-N/rank{R}.txt`` (the operators with the most self time, on the device where there is one)."""


@dataclass
class Validation:
    enable: bool = setting(False, resume="applied")
    """Measure validation loss during training."""
    freq: int = setting(500, resume="applied", ge=1)
    """Validate every this many steps."""
    steps: int = setting(20, resume="applied", ge=1)
    """Global batches per validation: the first ``steps x training.global_batch_size`` rows of the validation data,
    each global batch read as every rank's gradient-accumulation micro-batches. ``val_loss`` is the mean over their
    valid targets, so, as training's loss, it does not depend on the layout (local batch, accumulation,
    data-parallel degree). At most what the validation data holds: refused before the first step otherwise
    (streamed data, whose length is unknown, is checked for one global batch)."""
    dataset: str | None = setting(None, resume="applied")
    """Validation data (same forms as ``data.dataset``); None: the held-out split of the training data."""


@dataclass
class Data:
    dataset: str = setting(BUNDLED, resume="fixed")
    """``bundled``, a Hugging Face hub name, or local ``.jsonl``/``.parquet``/``.txt`` files (file, folder or
    glob)."""
    dataset_config: str | None = setting(None, resume="fixed")
    """Hub dataset configuration (subset) name."""
    split: str = setting("train", resume="fixed")
    """Split to train on."""
    text_field: str = setting("text", resume="fixed")
    """Column that holds the document text."""
    streaming: bool | None = setting(None, resume="fixed")
    """Stream instead of downloading; None: true for hub names, false for local files."""
    varlen: bool = setting(True, resume="fixed")
    """Pack documents into rows with document boundaries (no attention or state across documents); false:
    plain concatenation, every row one causal sequence."""
    holdout_every: int = setting(100, resume="fixed", ge=2, also=0)
    """Local data without ``train``/``validation`` sub-folders (one file, a glob, a plain folder): every N-th
    document in reading order is held out for validation and never trained on (at least 2: 1 would hold out every
    document). 0: no hold-out (validation on such data is then refused: it would read training documents). Bundled
    and hub data have their own splits."""
    token_cache: bool = setting(True, resume="launch")
    """Keep the tokenised documents of bundled and local data under ``job.cache_folder``/``tokens`` (keyed by
    the files' paths, sizes and content hashes, the split, hold-out and tokenizer), so the next process on
    the node (a resume, another run, another rank) reads them in about a second instead of tokenising again
    (a 120M-token corpus: 85 s on 16 cores). About 2 bytes a token (4 above 65,536 entries). False, or an empty
    ``job.cache_folder``: tokenise in every process."""
    allow_changed_data: bool = setting(False, resume="launch")
    """Resume even when the training data differs from what the checkpoint's run read (its fingerprint: per file
    the size and the sha256 of its content, kept per node in ``job.cache_folder``/``data_hashes``; hub data by
    name), with a warning. False: such a resume is refused in one line naming the files, since it would continue
    at a row of another document stream."""


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


class _Key(NamedTuple):
    section: str
    name: str
    hint: Any
    metadata: Mapping[str, Any]
    """What :func:`setting` recorded: the resume class and the bounds."""


def _keys() -> dict[str, _Key]:
    """``{"section.name": _Key}`` of every config key, in schema order."""
    keys = {}
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys[f"{section}.{f.name}"] = _Key(section, f.name, hints[f.name], f.metadata)
    return keys


_KEYS = _keys()


def resume_keys(resume: Resume) -> tuple[str, ...]:
    """The keys of one resume class, in schema order (``hola_titan/resume.py``)."""
    return tuple(key for key, entry in _KEYS.items() if entry.metadata.get("resume") == resume)


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


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce(key: str, hint: Any, value: Any, *, text: bool) -> Any:
    """``value`` as type ``hint``; ``text`` says it is a command-line string rather than a TOML value."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None or (text and value.strip().lower() in ("", "none", "null")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, inner, value, text=text)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"expected one of {', '.join(args)}; got {value!r}")
        return value
    if origin in (list, tuple):
        items = ([v.strip() for v in value.split(",")] if value.strip() else []) if text else value
        if not isinstance(items, (list, tuple)) or (origin is tuple and len(items) != len(args)):
            raise ConfigError(key, f"expected {_type_name(hint)}, got {value!r}")
        item_hints = args if origin is tuple else args * len(items)  # a tuple types each place, a list all alike
        return origin(_coerce(key, a, v, text=text) for a, v in zip(item_hints, items))
    parsed = None
    if text and hint is bool:
        word = value.strip().lower()
        parsed = True if word in _TRUE else False if word in _FALSE else None
    elif text:
        try:
            parsed = hint(value)
        except ValueError:
            pass
    elif not isinstance(value, bool) or hint is bool:  # bool is an int subclass, but never a number here
        if isinstance(value, (int, float) if hint is float else hint):
            parsed = float(value) if hint is float else value  # a TOML integer where a float is expected is fine
    if parsed is None:
        raise ConfigError(key, f"expected {_type_name(hint)}, got {value!r}")
    if hint is float and not math.isfinite(parsed):
        raise ConfigError(key, f"expected a finite float, got {value!r}")
    return parsed


def _key(key: str) -> _Key:
    """The schema entry of ``section.name``, or a ConfigError naming the key."""
    if key in _KEYS:
        return _KEYS[key]
    section, dot, _ = key.partition(".")
    if not dot or section not in SECTIONS:
        raise ConfigError(key, f"unknown config section {section!r}; sections are {', '.join(SECTIONS)}")
    names = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
    raise ConfigError(key, f"unknown key; {section} has {names}")


def _set(config: JobConfig, key: str, value: Any, *, text: bool) -> None:
    entry = _key(key)
    setattr(getattr(config, entry.section), entry.name, _coerce(key, entry.hint, value, text=text))


def _check_bounds(key: str, metadata: Mapping[str, Any], value: Any) -> None:
    """The bounds of a :func:`setting`; a two-sided range is named whole."""
    bounds = {name: metadata[name] for name in _BOUNDS if name in metadata}
    items = value if isinstance(value, (list, tuple)) else [value]
    for name, bound in bounds.items():
        holds, sign = _BOUNDS[name]
        if all(v is None or v == metadata.get("also") or holds(v, bound) for v in items):
            continue
        also = f" or {metadata['also']}" if "also" in metadata else ""
        low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds.get('gt')}"
        high = f"{bounds['le']}]" if "le" in bounds else f"{bounds.get('lt')})"
        span = f" (range {low}, {high})" if len(bounds) > 1 else ""
        each = "each value " if items is value else ""
        raise ConfigError(key, f"{each}must be {sign} {bound}{also}{span}, got {value}")


def check_fields(config: JobConfig) -> None:
    """Check every field on its own: type, choices, the bounds of its :func:`setting`. Raises :class:`ConfigError`."""
    for key, entry in _KEYS.items():
        value = getattr(getattr(config, entry.section), entry.name)
        _coerce(key, entry.hint, value, text=False)
        _check_bounds(key, entry.metadata, value)
    option = config.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option",
                          f"expected 'op' or a positive integer as a string, got {option!r}")


# ---------------------------------------------------------------------------------------------------------------
# Loading: TOML and command line
# ---------------------------------------------------------------------------------------------------------------


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError("job.config_file", f"no such file {path!r}") from None
    except IsADirectoryError:
        raise ConfigError("job.config_file", f"{path!r} is a folder, not a TOML file") from None
    except OSError as e:
        raise ConfigError("job.config_file", f"{path!r} cannot be read ({e.strerror})") from None
    try:
        # Decoded here rather than by tomllib, whose UnicodeDecodeError names neither the file nor the line.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError("job.config_file", f"{path!r} line {line} (byte offset {e.start}): byte "
                          f"0x{raw[e.start]:02x} is not valid UTF-8; TOML files are UTF-8 (save it as UTF-8)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("job.config_file", f"cannot parse TOML file {path!r}: {e}") from None


def _apply_tables(config: JobConfig, tables: dict[str, Any], *, source: str, known_only: bool) -> None:
    """Set the keys of parsed TOML; type errors name ``source``. ``known_only``: skip sections and keys this version
    does not know (an older run's record) instead of refusing them."""
    for section, table in tables.items():
        if known_only and (section not in SECTIONS or not isinstance(table, dict)):
            continue
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown config section in {source}; sections are {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a [{section}] table in {source}, got {table!r}")
        for name, value in table.items():
            key = f"{section}.{name}"
            if known_only and key not in _KEYS:
                continue
            try:
                _set(config, key, value, text=False)
            except ConfigError as e:
                raise ConfigError(e.key, f"{str(e).removeprefix(e.key + ': ')} (in {source})") from None


def config_from_text(text: str, *, source: str) -> JobConfig:
    """The config of TOML ``text`` over the defaults (e.g. the resolved config a checkpoint carries); keys this
    version does not know are skipped, so an older run's record still reads."""
    config = JobConfig()
    _apply_tables(config, tomllib.loads(text), source=source, known_only=True)
    return config


def flat_items(config: JobConfig) -> dict[str, Any]:
    """``{"section.key": value}`` of every config key."""
    return {f"{section}.{name}": value for section, table in to_dict(config).items() for name, value in table.items()}


def load_toml(path: str | os.PathLike[str]) -> JobConfig:
    """The config of a TOML file over the defaults, with no command line (e.g. a resolved ``config.toml``)."""
    config = JobConfig()
    _apply_tables(config, _read_toml(os.fspath(path)), source=repr(os.fspath(path)), known_only=False)
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
        _apply_tables(config, _read_toml(config_files[-1]), source=repr(config_files[-1]), known_only=False)
    for key, value in overrides:
        if value is None:  # a bare flag: true, for a boolean key (``bool`` or ``bool | None``) only
            hint = _key(key).hint
            if hint is not bool and set(get_args(hint)) != {bool, type(None)}:
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
    peak = steps / (warmup + 1)  # the factor of the last step, optim.lr_lambda(steps - 1)
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


def triton_cache_read_settings(model: Model) -> list[tuple[str, str]]:
    """The settings of ``model`` that are on and act only on a HOLA layer's cache read on the Triton backend:
    (key, what the setting does with the read), for the checks of :func:`validate` and of the trainer once it has
    resolved its backend."""
    settings = (("model.save_cache_output", model.save_cache_output, "keep"),
                ("model.cache_kernels", model.cache_kernels != "auto", "run"))
    return [(key, verb) for key, on, verb in settings if on]


def run_folders(config: JobConfig) -> list[tuple[str, Path]]:
    """``(key, folder)`` of the folders a run writes: the run folder and, with checkpointing on, the checkpoint
    folder (``checkpoint.folder`` under it, or wherever an absolute one leads)."""
    dump = Path(config.job.dump_folder)
    folders = [("job.dump_folder", dump)]
    if config.checkpoint.enable:
        folders.append(("checkpoint.folder", dump / config.checkpoint.folder))
    return folders


def check_run_folders(config: JobConfig) -> None:
    """Refuse, in one line naming the key, folders of :func:`run_folders` that cannot serve the run (a file in the
    way, a symbolic link loop, a dangling link, a name too long), and a checkpoint folder in which files cannot be
    made, which the first save would otherwise find out a whole interval later. Makes nothing."""
    from hola_titan.runfolder import RunFolderError, check_folder_path, check_writable_folder

    for key, folder in run_folders(config):
        try:
            (check_writable_folder if key == "checkpoint.folder" else check_folder_path)(folder, key=key)
        except RunFolderError as err:
            raise ConfigError(key, str(err)) from None


def overlap_backward(model: Model) -> bool:
    """``model.overlap_backward`` resolved: unset means on unless ``model.save_cache_output`` is on."""
    return (not model.save_cache_output) if model.overlap_backward is None else model.overlap_backward


STATE_BYTES_PER_PARAMETER = 16
"""Float32 weight and gradient and AdamW's two float32 moments: what training keeps per parameter at the least."""


def check_memory(config: JobConfig, args: ModelArgs, degrees: ParallelDegrees, *, device_bytes: int,
                 device_what: str, host_bytes: int, host_what: str) -> None:
    """Refuse, naming the key that sizes it, a run whose rank cannot hold what training needs at the least
    (a floor, not an estimate: a run refused here could not have run; one that passes may still run out of memory):

    - the training state, :data:`STATE_BYTES_PER_PARAMETER` bytes a weight of the matmuls (``flops.matmul_params``,
      fewer than the model's parameters), over the FSDP shards and the tensor-parallel degree; on the host with
      ``parallelism.fsdp_cpu_offload``. Named ``model.n_layers`` when set, else ``model.size``.
    - the activations the backward needs: every block's input, even when activation checkpointing recomputes the
      rest (``local_batch_size x seq_len`` tokens of ``dim`` values per block, over the context- and
      tensor-parallel degrees; 2 bytes a value with bfloat16 compute, else 4). Named
      ``training.local_batch_size`` (``training.seq_len`` at one row).

    ``device_bytes`` / ``host_bytes``: the memory one rank may use of its device and of the host (its share of the
    host's memory when the node's processes share it); ``device_what`` / ``host_what`` say what they are. On a CPU
    both are the host's. Raises :class:`ConfigError`.
    """
    from hola_titan.flops import matmul_params

    gib = 2 ** 30
    training = config.training
    params = matmul_params(args)
    state = STATE_BYTES_PER_PARAMETER * params / (degrees.dp_shard * degrees.tp)
    value_bytes = 2 if training.mixed_precision_param == "bfloat16" else 4
    activations = (training.local_batch_size * training.seq_len * args.dim * args.n_layers * value_bytes
                   / (degrees.cp * degrees.tp))
    offload = config.parallelism.fsdp_cpu_offload
    state_bytes, state_what = (host_bytes, host_what) if offload else (device_bytes, device_what)
    if state > state_bytes:
        key = "model.n_layers" if config.model.n_layers is not None else "model.size"
        raise ConfigError(key, f"{args.flavour} {args.size} with {args.n_layers} blocks has at least {params:,} "
                          "parameters, whose float32 weights, gradients and AdamW moments "
                          f"({STATE_BYTES_PER_PARAMETER} bytes each) over data_parallel_shard_degree "
                          f"{degrees.dp_shard} x tensor_parallel_degree "
                          f"{degrees.tp} need at least {state / gib:,.1f} GiB per rank, more than the "
                          f"{state_bytes / gib:,.1f} GiB of {state_what}; shard it over more ranks, or train a "
                          "smaller model")
    room = device_bytes - (0 if offload else state)
    if activations > room:
        key = "training.local_batch_size" if training.local_batch_size > 1 else "training.seq_len"
        over = f" over context {degrees.cp} x tensor {degrees.tp}" if degrees.cp * degrees.tp > 1 else ""
        raise ConfigError(key, f"{training.local_batch_size} rows x {training.seq_len} tokens "
                          f"(training.local_batch_size x training.seq_len) keep at least {activations / gib:,.1f} GiB "
                          f"of block inputs per rank for the backward ({args.n_layers} blocks x {args.dim} values x "
                          f"{value_bytes} bytes a token{over}), more than the {room / gib:,.1f} GiB that "
                          f"{device_what} has left beside the training state; lower training.local_batch_size "
                          "(training.global_batch_size keeps the batch by accumulation) or training.seq_len")


def validate(config: JobConfig, *, world_size: int) -> None:
    """Checks across fields that must pass before any model is built. Raises :class:`ConfigError`.

    The GPU's float8 support is checked later, at runtime; here float8 only requires ``training.device cuda``.
    """
    check_fields(config)
    degrees = resolve_degrees(config.parallelism, config.training, world_size=world_size)
    model = config.model
    try:
        args = model_args(model.flavour, model.size, vocab_size=1, window=model.window, block=model.block,
                          n_layers=model.n_layers, state_read_scale=model.state_read_scale,
                          gate_init=model.gate_init, cache_mix=model.cache_mix, cache_sink=model.cache_sink)
    except ValueError as e:
        key, _, problem = str(e).partition(": ")
        raise ConfigError(key, problem) from None
    if args.n_heads % degrees.tp:
        raise ConfigError("parallelism.tensor_parallel_degree",
                          f"{degrees.tp} does not divide the {args.n_heads} heads of {model.flavour} {model.size}")
    seq_len = config.training.seq_len
    if args.is_recurrent and args.block > seq_len:
        # Blocks are aligned to row starts: a longer one is never complete (and seq_len could not be its multiple).
        raise ConfigError("model.block", f"{args.block} is more than the {seq_len} tokens of a training row "
                          f"(training.seq_len); at most {seq_len}")
    if args.is_recurrent and seq_len % args.block:
        raise ConfigError("training.seq_len", f"{seq_len} is not a multiple of block {args.block}")
    if args.is_recurrent and args.evict != "none" and args.window > seq_len:
        # A row holds at most seq_len tokens, so a larger cache holds nothing more; it only allocates (a window of
        # 100,000 grew a debug run's worker to 24 GB before the host killed it, 2026-12-05).
        raise ConfigError("model.window", f"{args.window} is more than the {seq_len} tokens of a training row "
                          f"(training.seq_len): the cache could never fill; at most {seq_len}")
    if degrees.cp > 1 and seq_len % degrees.cp:
        raise ConfigError("training.seq_len", f"{seq_len} is not a multiple of context_parallel_degree {degrees.cp}")
    if args.is_recurrent and degrees.cp > 1 and seq_len // degrees.cp < args.conv_size - 1:
        # A shard may end inside a block (the next rank continues it), but the convolution tails come from the
        # previous shard alone.
        raise ConfigError("training.seq_len", f"{seq_len} over context_parallel_degree {degrees.cp} leaves shards of "
                          f"{seq_len // degrees.cp} tokens, fewer than conv_size - 1 = {args.conv_size - 1}")
    chunk = config.training.loss_chunk_size
    if chunk and degrees.tp > 1:
        raise ConfigError("training.loss_chunk_size", f"{chunk} has no effect with tensor_parallel_degree "
                          f"{degrees.tp} (the logits are sharded over the vocabulary instead); leave it 0")
    micro_tokens = config.training.local_batch_size * seq_len // degrees.cp
    if chunk > micro_tokens:
        cp = f" / context_parallel_degree {degrees.cp}" if degrees.cp > 1 else ""
        raise ConfigError("training.loss_chunk_size", f"{chunk} is more than the {micro_tokens} tokens of a rank's "
                          f"micro-batch (training.local_batch_size x training.seq_len{cp}), all of which one chunk "
                          f"already holds; at most {micro_tokens} (0 chooses)")
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
    # What the config alone decides about the settings that act on the Triton backend's cache read; an auto backend
    # is checked once the trainer has resolved it (Trainer).
    has_cache = args.is_recurrent and args.evict != "none"
    for key, changed in (("model.gate_init", model.gate_init is not None),
                         ("model.cache_mix", model.cache_mix != "before_norm"),
                         ("model.cache_sink", not model.cache_sink),
                         ("optimizer.decay_cache_scalars", not config.optimizer.decay_cache_scalars),
                         ("optimizer.cache_lr_multiplier", config.optimizer.cache_lr_multiplier != 1.0)):
        if changed and not has_cache:
            raise ConfigError(key, f"{model.flavour} has no HOLA cache (its gate, sink and gammas)")
    if model.state_read_scale != "inv_sqrt_head_dim" and not args.is_recurrent:
        raise ConfigError("model.state_read_scale", f"{model.flavour} has no recurrent state to read")
    cache_read_settings = triton_cache_read_settings(model)
    for key, verb in cache_read_settings:
        if not args.is_recurrent or args.evict == "none":
            raise ConfigError(key, f"{model.flavour} has no HOLA cache read to {verb}")
    if model.save_cache_output and model.overlap_backward is True:
        raise ConfigError("model.save_cache_output", "not available with model.overlap_backward true; choose one "
                                                     "(left unset, overlap_backward gives way to it)")
    for key, _ in cache_read_settings:
        if model.attention_backend in ("reference", "sdpa", "fa4"):
            raise ConfigError(key, f"needs the Triton attention backend; model.attention_backend is "
                                   f"{model.attention_backend}")
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


def _toml_value(value: bool | int | float | str | list) -> str:
    # JSON's literals of these types are TOML's (the same escapes), except that TOML escapes DEL too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


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
    from hola_titan.staging import write_text_atomic

    return write_text_atomic(path, text)  # never torn: a resume and the converter read it


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
    docs, defaults = field_docs(), flat_items(JobConfig())
    lines = ["Options: --job.config_file PATH, --section.key VALUE (overrides the TOML file), --dry-run."]
    section = None
    for key, entry in _KEYS.items():
        if entry.section != section:
            section = entry.section
            lines.append(f"\n[{section}]")
        lines.append(f"  --{key} ({_type_name(entry.hint)}; default {defaults[key]!r})")
        lines.append(f"      {docs.get(key, '')}")
    return "\n".join(lines)
