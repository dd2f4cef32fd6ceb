"""The critical path of context parallelism pipelined over layers: a step time from one GPU's stage timings.

The pipelined protocol (hola_titan/parallelisms/context_parallel.py): rank r runs its shard of layer l once it has
its own layer l-1 output and the state and cache that rank r-1 sends when it finishes its shard of layer l; the
backward runs the same wavefront in reverse (rank r's backward of layer l waits for the gradient of its outgoing
state and cache from rank r+1's backward of layer l). With stage times and a message cost this is a
longest-path recurrence:

    F[r][l] = max(F[r][l-1], F[r-1][l] + msg) + fwd[r]           (forward, l = 0 .. n-1)
    B[r][l] = max(B[r][l+1], B[r+1][l] + msg) + bwd[r]           (backward, l = n-1 .. 0)
    B[r][n] = F[r][n-1] + head[r]                                (each rank's head and loss, forward and backward)

and the step ends at ``max_r B[r][0]``, plus what every rank runs whole after the backward (the optimizer) and the
gradient all-reduce over the context-parallel ranks (parameters are replicated there). Assumptions, stated where
the prediction is printed: stage times are those measured on one GPU for a shard of the rank's length (rank 0
starts its document fresh, later ranks continue one); the host never lags the GPU; a message costs ``latency +
bytes / bandwidth`` and overlaps nothing; the all-reduce overlaps nothing; one GPU's step at R times the tokens is
R times the layer and head work at one shard's length (the layer is linear in T: checked against a measurement at
2T) plus one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stages:
    """Milliseconds of one shard's work (one GPU's timings), and the costs around them."""

    layer_fwd_fresh: float
    layer_bwd_fresh: float
    layer_fwd_cont: float
    layer_bwd_cont: float
    head: float
    """Embedding, final norm, head and loss, forward and backward, at one shard's length."""
    optimizer: float
    message: float
    """One point-to-point message of a layer's state and cache (forward) or their gradients (backward)."""
    allreduce: float
    """The gradient all-reduce over the context-parallel ranks (0 at R = 1)."""


def pipelined_step_ms(stages: Stages, *, num_layers: int, ranks: int) -> float:
    """The step time of the pipelined protocol over ``ranks`` ranks (module docstring's recurrence)."""
    if num_layers < 1 or ranks < 1:
        raise ValueError(f"num_layers and ranks must be >= 1, got {num_layers} and {ranks}")
    n, big_r = num_layers, ranks
    fwd = [stages.layer_fwd_fresh] + [stages.layer_fwd_cont] * (big_r - 1)
    bwd = [stages.layer_bwd_fresh] + [stages.layer_bwd_cont] * (big_r - 1)
    neg = float("-inf")
    f = [[0.0] * n for _ in range(big_r)]
    for r in range(big_r):
        for layer in range(n):
            ready = f[r][layer - 1] if layer else 0.0
            upstream = f[r - 1][layer] + stages.message if r else neg
            f[r][layer] = max(ready, upstream) + fwd[r]
    b = [[0.0] * (n + 1) for _ in range(big_r)]
    for r in reversed(range(big_r)):
        b[r][n] = f[r][n - 1] + stages.head
        for layer in reversed(range(n)):
            downstream = b[r + 1][layer] + stages.message if r + 1 < big_r else neg
            b[r][layer] = max(b[r][layer + 1], downstream) + bwd[r]
    return max(b[r][0] for r in range(big_r)) + stages.optimizer + (stages.allreduce if big_r > 1 else 0.0)


def one_gpu_step_ms(stages: Stages, *, num_layers: int, ranks: int) -> float:
    """One GPU at ``ranks`` times a shard's tokens: that many shards' layer and head work, one optimizer step."""
    per_shard = num_layers * (stages.layer_fwd_fresh + stages.layer_bwd_fresh) + stages.head
    return ranks * per_shard + stages.optimizer


def allreduce_ms(nbytes: int, *, ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """A ring all-reduce of ``nbytes``: ``2 (R-1)/R`` of the bytes cross each link, plus ``2 (R-1)`` latencies."""
    if ranks <= 1:
        return 0.0
    return 1e3 * 2 * (ranks - 1) / ranks * nbytes / (bandwidth_gbps * 1e9) + 2 * (ranks - 1) * latency_us / 1e3


def message_ms(nbytes: int, *, bandwidth_gbps: float, latency_us: float) -> float:
    return latency_us / 1e3 + 1e3 * nbytes / (bandwidth_gbps * 1e9)
