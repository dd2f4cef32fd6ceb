"""The critical-path model of context parallelism pipelined over layers (hola_titan/parallelisms/critical_path.py)."""

from __future__ import annotations

import pytest

from hola_titan.parallelisms.critical_path import (Stages, allreduce_ms, message_ms, one_gpu_step_ms,
                                                   pipelined_step_ms)


def _stages(**kw) -> Stages:
    base = dict(layer_fwd_fresh=1.0, layer_bwd_fresh=2.0, layer_fwd_cont=1.0, layer_bwd_cont=2.0, head=0.0,
                optimizer=0.0, message=0.0, allreduce=0.0)
    return Stages(**{**base, **kw})


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("layers", [1, 3, 24])
def test_equal_stages_give_the_wavefront(ranks, layers):
    # Forward and backward each take (n + R - 1) stage times: the wavefront of the estimate.
    assert pipelined_step_ms(_stages(), num_layers=layers, ranks=ranks) == pytest.approx(3.0 * (layers + ranks - 1))
    assert one_gpu_step_ms(_stages(), num_layers=layers, ranks=ranks) == pytest.approx(3.0 * layers * ranks)


def test_messages_head_and_a_slower_continuing_rank():
    # Each of the R - 1 hops costs one message in forward and one in backward.
    st = _stages(message=0.5)
    assert pipelined_step_ms(st, num_layers=4, ranks=3) == pytest.approx(3.0 * 6 + 2 * 2 * 0.5)
    # The head runs on every rank between its forward and its backward; the last rank's is on the path.
    assert pipelined_step_ms(_stages(head=5.0), num_layers=4, ranks=2) == pytest.approx(3.0 * 5 + 5.0)
    # Continuing ranks slower than rank 0: the path follows the slow stages (rank 0 fresh, ranks 1..R-1 slow).
    slow = _stages(layer_fwd_cont=2.0, layer_bwd_cont=3.0)
    # Forward: rank 0's first layer (1), then rank 1's 4 layers (2 each); backward: rank 1's 4 layers (3 each),
    # then rank 0's first layer (2).
    assert pipelined_step_ms(slow, num_layers=4, ranks=2) == pytest.approx(1 + 4 * 2 + 4 * 3 + 2)
    # The optimizer and the all-reduce are added once; the all-reduce only with more than one rank.
    st = _stages(optimizer=7.0, allreduce=3.0)
    assert pipelined_step_ms(st, num_layers=2, ranks=1) == pytest.approx(3.0 * 2 + 7.0)
    assert pipelined_step_ms(st, num_layers=2, ranks=2) == pytest.approx(3.0 * 3 + 7.0 + 3.0)


def test_costs_and_bad_input():
    assert allreduce_ms(10**9, ranks=1, bandwidth_gbps=100, latency_us=20) == 0.0
    assert allreduce_ms(10**9, ranks=2, bandwidth_gbps=100, latency_us=0) == pytest.approx(10.0)
    assert message_ms(10**6, bandwidth_gbps=100, latency_us=20) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="num_layers and ranks must be >= 1"):
        pipelined_step_ms(_stages(), num_layers=0, ranks=2)
