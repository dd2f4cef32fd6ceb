"""A training step's time under FSDP2, HSDP and tensor parallelism, from one GPU's compute times and link costs.

FSDP2 as ``parallelize.apply_fsdp`` applies it runs two streams per rank: compute, and the collectives (one link).
Per micro-batch, with ``L`` blocks of forward time ``f`` and backward time ``b`` each:

- forward: the root's parameters are all-gathered first (exposed); block i's all-gather ``AG_i`` is issued when
  block i-1 starts computing (FSDP2 prefetches one block ahead) and block i starts once ``AG_i`` and block i-1 are
  done;
- the head (final norm, output head, loss; forward and backward) runs on gathered root parameters;
- backward, blocks L-1 .. 0: the last block keeps its parameters after forward (``reshard_after_forward`` is off
  for it), every other block is gathered again, issued when the block after it starts its backward; block j's
  gradients are reduce-scattered ``RS_j`` once its backward ends (and, with HSDP, all-reduced over the replicas
  ``AR_j`` after that); the root's reduce-scatter follows the last block's;
- the collectives run one after another in the order they are issued (one link, shared);
- the optimizer starts when the last reduction is done and updates this rank's shard.

Tensor parallelism divides a block's compute by its degree and adds its sequence-parallel collectives, which
run on the compute stream (nothing overlaps them): per block, forward two all-gathers (token mixer and MLP inputs)
and two reduce-scatters (their outputs), the same four again in backward, each of the micro-batch's activations
``tokens x dim`` in bf16. Assumptions (stated where a prediction is printed): compute times scale with the work
(1/tp, 1/cp) without loss of kernel efficiency; the host never lags the GPU; a collective costs ``latency (R - 1)
+ bytes (R - 1) / R / bus bandwidth`` (NCCL's bus-bandwidth convention); TP's and FSDP's collectives do not slow
each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of one rank's work in one micro-batch, and of the collectives around it."""

    block_fwd: float
    """One block's forward (its compute alone)."""
    block_bwd: float
    """One block's backward (with activation checkpointing: its recomputed forward too)."""
    head: float
    """Embedding, final norm, output head and loss, forward and backward."""
    optimizer: float
    """The optimizer step over this rank's parameter shard, once per step."""
    gather: float = 0.0
    """All-gather of one block's parameters (0: nothing gathered, e.g. one GPU)."""
    scatter: float = 0.0
    """Reduce-scatter of one block's gradients."""
    replicate: float = 0.0
    """HSDP: all-reduce of one block's gradient shard over the replicas."""
    root_gather: float = 0.0
    root_scatter: float = 0.0
    root_replicate: float = 0.0


def collective_ms(nbytes: float, *, ranks: int, bus_gbps: float, latency_us: float) -> float:
    """An all-gather or reduce-scatter whose whole (unsharded) buffer is ``nbytes``: ``(R-1)/R`` of it crosses
    each rank's link, plus one latency per ring step; 0 for one rank."""
    if ranks <= 1:
        return 0.0
    return 1e3 * nbytes * (ranks - 1) / ranks / (bus_gbps * 1e9) + (ranks - 1) * latency_us / 1e3


def allreduce_ms(nbytes: float, *, ranks: int, bus_gbps: float, latency_us: float) -> float:
    """A ring all-reduce of ``nbytes``: a reduce-scatter and an all-gather of the same buffer."""
    return 2 * collective_ms(nbytes, ranks=ranks, bus_gbps=bus_gbps, latency_us=latency_us)


class _Link:
    """The collectives of one rank, run one after another in the order they are issued."""

    def __init__(self):
        self.free_at = 0.0

    def run(self, ms: float, *, issued_at: float) -> float:
        if ms <= 0.0:
            return issued_at
        self.free_at = max(self.free_at, issued_at) + ms
        return self.free_at


def fsdp_step_ms(costs: StepCosts, *, num_layers: int, microbatches: int = 1) -> float:
    """One step of ``microbatches`` forward and backward passes and one optimizer step (module docstring)."""
    if num_layers < 1 or microbatches < 1:
        raise ValueError(f"num_layers and microbatches must be >= 1, got {num_layers} and {microbatches}")
    n, c = num_layers, costs
    link, now = _Link(), 0.0
    for _ in range(microbatches):
        now = link.run(c.root_gather, issued_at=now)
        # Forward: AG_i issued when block i-1 starts (block 0's right after the root's).
        gathered = [0.0] * n
        gathered[0] = link.run(c.gather, issued_at=now)
        for i in range(n):
            start = max(now, gathered[i])
            if i + 1 < n:
                gathered[i + 1] = link.run(c.gather, issued_at=start)
            now = start + c.block_fwd
        now += c.head
        # Backward: the last block's parameters are still gathered; AG_j issued when block j+1 starts.
        ready = now
        for j in reversed(range(n)):
            start = max(now, ready)
            ready = link.run(c.gather, issued_at=start) if j > 0 else 0.0
            now = start + c.block_bwd
            reduced = link.run(c.scatter, issued_at=now)
            link.run(c.replicate, issued_at=reduced)
        reduced = link.run(c.root_scatter, issued_at=now)
        link.run(c.root_replicate, issued_at=reduced)
        # The next micro-batch's root all-gather waits for the link; its compute for this one's.
    return max(now, link.free_at) + c.optimizer


def tensor_parallel_block(fwd: float, bwd: float, *, tp: int, activation_bytes: float, bus_gbps: float,
                          latency_us: float) -> tuple[float, float]:
    """A block's forward and backward milliseconds at tensor-parallel degree ``tp`` (sequence parallel): the
    compute divided by ``tp`` plus four exposed collectives each way of ``activation_bytes`` (the micro-batch's
    ``tokens x dim`` in bf16, whole)."""
    if tp <= 1:
        return fwd, bwd
    per = collective_ms(activation_bytes, ranks=tp, bus_gbps=bus_gbps, latency_us=latency_us)
    return fwd / tp + 4 * per, bwd / tp + 4 * per
