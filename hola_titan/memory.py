"""A per-device memory estimate of one training step, from the model's shapes and the run's layout; ``--dry-run``
prints it before a job is queued. It is an estimate, not a measurement, and counts:

- **state**: float32 master parameters, float32 gradients and the optimizer's float32 moments (AdamW: two), each
  split over the ranks FSDP shards over (data-parallel shard x context parallel, or the replicate ranks when they
  are the only data-parallel ones, ``hola_titan/parallelisms/parallelize.py``) and over tensor parallel. With
  ``parallelism.fsdp_cpu_offload`` they live in host memory and count 0 on the device;
- **weights in the compute dtype**: under FSDP the unsharded parameters of two blocks (the one running and the one
  prefetched) and of the root (embedding, head); without FSDP, autocast's copies of every weight, kept for the
  backward (none when the compute dtype is float32);
- **activations** saved for the backward of one micro-batch (``local_batch_size`` rows of ``seq_len /
  context_parallel_degree`` tokens; accumulation steps run one after another and add nothing), per block, from
  what each module saves (counted with ``scripts/saved_activations.py``: the two norms' float32 inputs, the
  projections' inputs, the short convolutions' inputs, SwiGLU's two inputs) and, for the token mixer's core, five
  head-width tensors per token (q, k, v, the output and the chunked form's own, calibrated on the H200's measured
  peak below). Activation checkpointing keeps each wrapped block's float32 input instead, plus one block
  recomputed during its backward (``selective`` with ``op`` also keeps the matmul outputs);
- **the loss**: the final norm's input, the head's float32 gradients (computed in the forward) and one chunk of
  logits (all of them, vocabulary-sharded, under tensor parallelism).

Not counted: the CUDA context and the allocator's fragmentation (often 1-3 GiB), kernels' workspaces, what
``torch.compile`` or float8 save, and gradients of the backward in flight beyond one block. Calibration: HOLA
340M, 16 rows of 2048 tokens, one GPU, bf16 compute, no checkpointing: measured peak 38.18 GiB on an H200
(docs/training.md), estimate 38.6 GiB (``tests/test_train.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from hola_titan.config import JobConfig, ParallelDegrees
from hola_titan.loss import AUTO_CHUNK_BYTES
from hola_titan.models.args import ModelArgs

GIB = 2**30
FLOAT32 = 4
OPTIMIZER_MOMENTS = {"AdamW": 2}  # float32 tensors of the parameter's size the optimizer keeps per parameter
CORE_TENSORS = 5  # head-width tensors per token the token mixer's core saves (calibrated; see the docstring)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (see the module docstring for what each counts)."""

    params: float
    grads: float
    optimizer: float
    fsdp_ranks: int  # ranks FSDP splits each parameter's state over (times tensor parallel: state_shards)
    tp: int
    offloaded: bool  # parameters, gradients and optimizer state in host memory
    compute_weights: float
    compute_weights_what: str
    activations: dict[str, float]  # by activation-checkpointing mode: "none", "full" and the configured one
    ac_mode: str  # the configured mode, as a key of ``activations`` ("selective 2", "selective op", ...)
    loss: float
    compute_dtype: str
    micro_tokens: int  # tokens per device per micro-batch

    @property
    def state_shards(self) -> int:
        return self.fsdp_ranks * self.tp

    @property
    def state(self) -> float:
        return 0.0 if self.offloaded else self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.compute_weights + self.activations[self.ac_mode] + self.loss


def fsdp_ranks(degrees: ParallelDegrees) -> int:
    """Ranks FSDP splits one parameter's state over (tensor parallelism splits it further)."""
    if degrees.dp_shard * degrees.cp > 1:
        return degrees.dp_shard * degrees.cp
    return degrees.dp_replicate  # the replicate ranks when they are the only data-parallel ones; 1 without FSDP


def block_bytes_per_token(args: ModelArgs, *, compute: int, tp: int) -> dict[str, float]:
    """Bytes one block saves for its backward per token, by what saves them: ``norms`` (the two RMSNorms' float32
    inputs: the residual stream, sequence-sharded under tensor parallelism), ``inputs`` (the normed inputs the
    mixer's and the MLP's input projections keep, whole under tensor parallelism), ``mixer`` and ``mlp``."""
    hd = args.n_heads * args.head_dim
    if args.is_recurrent:
        # Three short convolutions' inputs, o_norm's and o_proj's inputs, the output gate, and the core.
        mixer = (3 + 1 + 1 + (1 if args.use_gate else 0) + CORE_TENSORS) * hd
    else:
        # q, k and v after RoPE with its pieces, the attention output (o_proj's input): the core's measured total.
        mixer = CORE_TENSORS * hd
    return {"norms": 2 * args.dim * FLOAT32 / tp, "inputs": 2 * args.dim * compute,
            "mixer": mixer * compute / tp, "mlp": 2 * args.mlp_hidden * compute / tp}


def checkpointed_bytes_per_token(args: ModelArgs, *, compute: int, tp: int, op_level: bool) -> float:
    """Bytes a checkpointed block keeps per token: its float32 input, and with op-level selective checkpointing
    the outputs of its matmuls (and of the attention under Transformer++)."""
    kept = args.dim * FLOAT32 / tp
    if op_level:
        hd = args.n_heads * args.head_dim
        matmuls = 3 * hd + (hd if args.use_gate else 0) + 2 * args.dim + 2 * args.mlp_hidden
        if not args.is_recurrent:
            matmuls += hd  # SDPA's output
        kept += matmuls * compute / tp
    return kept


def activation_bytes(args: ModelArgs, *, tokens: int, compute: int, tp: int, mode: str, option: str = "2") -> float:
    """Activations of one micro-batch of ``tokens`` tokens per device under checkpointing ``mode``
    (``none``, ``full`` or ``selective`` with ``option``)."""
    block = sum(block_bytes_per_token(args, compute=compute, tp=tp).values())
    layers = args.n_layers
    if mode == "none":
        return tokens * layers * block
    if mode == "full":
        wrapped, every, op_level = layers, 1, False
    elif mode == "selective" and option == "op":
        wrapped, every, op_level = layers, 1, True
    elif mode == "selective" and option.isdigit() and int(option) >= 1:
        every, op_level = int(option), False
        wrapped = math.ceil(layers / every)  # blocks 0, N, 2N, ... (apply_activation_checkpointing)
    else:
        raise ValueError(f"activation_checkpoint: mode {mode!r} with selective_ac_option {option!r}")
    kept = checkpointed_bytes_per_token(args, compute=compute, tp=tp, op_level=op_level)
    # A wrapped block's backward first recomputes its forward: one block's full activations at a time.
    return tokens * (wrapped * kept + (layers - wrapped) * block + block)


def _ac_key(mode: str, option: str) -> str:
    return f"selective {option}" if mode == "selective" else mode


def estimate_memory(args: ModelArgs, config: JobConfig, degrees: ParallelDegrees, model: nn.Module) -> MemoryEstimate:
    """The estimate for ``model`` (built on the meta device from ``args``) trained with ``config`` at ``degrees``."""
    training, par = config.training, config.parallelism
    # On a CPU the compute stays float32 whatever the config says (hola_titan/parallelisms/parallelize.py).
    compute_name = "float32" if training.device == "cpu" else training.mixed_precision_param
    compute = 2 if compute_name == "bfloat16" else FLOAT32
    tp, cp = degrees.tp, degrees.cp
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in next(iter(model.layers.values())).parameters())
    root = total - args.n_layers * block
    shards = fsdp_ranks(degrees) * tp
    moments = OPTIMIZER_MOMENTS[config.optimizer.name]
    if fsdp_ranks(degrees) > 1:  # FSDP applies (parallelize_model)
        compute_weights = (2 * block + root) * compute / tp
        what = f"FSDP's unsharded {compute_name} weights of two blocks and the embedding and head"
    elif compute < FLOAT32:
        compute_weights = total * compute / tp
        what = f"autocast's {compute_name} copies of the weights, kept for the backward"
    else:
        compute_weights, what = 0.0, "none: float32 compute uses the weights as they are"
    tokens = training.local_batch_size * training.seq_len // cp
    option = config.activation_checkpoint.selective_ac_option
    activations = {"none": activation_bytes(args, tokens=tokens, compute=compute, tp=tp, mode="none"),
                   "full": activation_bytes(args, tokens=tokens, compute=compute, tp=tp, mode="full")}
    mode = config.activation_checkpoint.mode
    key = _ac_key(mode, option)
    if key not in activations:
        activations[key] = activation_bytes(args, tokens=tokens, compute=compute, tp=tp, mode=mode, option=option)
    vocab = args.vocab_size
    if tp > 1:  # loss parallel: every token's logits, vocabulary-sharded, in float32
        logits = tokens * vocab / tp * FLOAT32
    else:
        rows = training.loss_chunk_size or AUTO_CHUNK_BYTES // (FLOAT32 * vocab)
        logits = min(rows, tokens) * vocab * FLOAT32
    loss = tokens * 2 * args.dim * FLOAT32 / tp + vocab * args.dim * FLOAT32 / tp + logits
    return MemoryEstimate(params=total * FLOAT32 / shards, grads=total * FLOAT32 / shards,
                          optimizer=moments * total * FLOAT32 / shards, fsdp_ranks=fsdp_ranks(degrees), tp=tp,
                          offloaded=par.fsdp_cpu_offload, compute_weights=compute_weights, compute_weights_what=what,
                          activations=activations, ac_mode=key, loss=loss, compute_dtype=compute_name,
                          micro_tokens=tokens)


def batch_line(config: JobConfig, degrees: ParallelDegrees) -> str:
    """Gradient accumulation in one line: micro-batch, data-parallel ranks, accumulation steps, global batch."""
    t = config.training
    micro = t.local_batch_size * degrees.dp
    return (f"batch: micro-batch {t.local_batch_size} row(s) x {t.seq_len} tokens per data-parallel rank "
            f"(training.local_batch_size) x {degrees.dp} data-parallel rank(s) = {micro} rows; "
            f"{degrees.grad_accum_steps} accumulation step(s); global batch {degrees.global_batch_size} rows = "
            f"{degrees.global_batch_size * t.seq_len:,} tokens per optimizer step (training.global_batch_size)")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def describe(estimate: MemoryEstimate, config: JobConfig) -> list[str]:
    """The dry run's lines for ``estimate``."""
    e = estimate
    where = {"cpu": "process (CPU)", "cuda": "GPU"}.get(config.training.device, "device")
    state = (f"parameters {_size(e.params)}, gradients {_size(e.grads)}, {config.optimizer.name} state "
             f"{_size(e.optimizer)} (float32, each split over {e.fsdp_ranks} FSDP x {e.tp} tensor-parallel rank(s))")
    if e.offloaded:
        state += "; in host memory (parallelism.fsdp_cpu_offload), 0 on the device"
    others = ", ".join(f"{mode} {_size(b)}" for mode, b in e.activations.items() if mode != e.ac_mode)
    return [
        f"memory estimate per {where} (an estimate from the model's shapes, not a measurement; {e.compute_dtype} "
        "compute, eager; the CUDA context, allocator fragmentation and kernel workspaces are not counted):",
        f"  state: {state}",
        f"  weights in the compute dtype: {_size(e.compute_weights)} ({e.compute_weights_what})",
        f"  activations: {_size(e.activations[e.ac_mode])} for a micro-batch of {e.micro_tokens:,} tokens per "
        f"device with activation_checkpoint.mode {e.ac_mode} (other modes: {others})",
        f"  loss: {_size(e.loss)} (the final norm's input, the head's float32 gradients and one chunk of logits)",
        f"  total: {_size(e.total)}",
    ]
