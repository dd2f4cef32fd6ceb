"""The FSDP2 / TP step model (hola_titan/parallelisms/step_model.py) on hand-made costs whose answer is known."""

from __future__ import annotations

import pytest

from hola_titan.parallelisms.step_model import (StepCosts, allreduce_ms, collective_ms, fsdp_step_ms,
                                                tensor_parallel_block)


def test_without_collectives_the_step_is_the_compute():
    costs = StepCosts(block_fwd=1.0, block_bwd=2.0, head=0.5, optimizer=1.0)
    # Two micro-batches of 3 blocks and the head each, one optimizer step.
    assert fsdp_step_ms(costs, num_layers=3, microbatches=2) == pytest.approx(2 * (3 * 3.0 + 0.5) + 1.0)


def test_slow_gathers_are_exposed_and_the_last_block_is_not_gathered_again():
    costs = StepCosts(block_fwd=1.0, block_bwd=2.0, head=0.0, optimizer=0.0, gather=3.0)
    # Forward: AG0 0-3, block 0 3-4, AG1 (issued at 3) 3-6, block 1 6-7. Backward: block 1 keeps its parameters,
    # 7-9; AG0 issued at 7, 7-10; block 0 10-12.
    assert fsdp_step_ms(costs, num_layers=2) == pytest.approx(12.0)
    # Gathers faster than a block hide behind it but the first one.
    fast = StepCosts(block_fwd=1.0, block_bwd=2.0, head=0.0, optimizer=0.0, gather=0.5)
    assert fsdp_step_ms(fast, num_layers=4) == pytest.approx(0.5 + 4 * 3.0)


def test_reductions_queue_on_the_link_and_the_optimizer_waits_for_them():
    costs = StepCosts(block_fwd=1.0, block_bwd=1.0, head=0.0, optimizer=2.0, scatter=5.0)
    # Backward: block 1 2-3, RS1 3-8; block 0 3-4, RS0 waits for the link: 8-13; then the optimizer.
    assert fsdp_step_ms(costs, num_layers=2) == pytest.approx(13.0 + 2.0)
    # HSDP: each reduce-scatter is followed by the all-reduce over replicas, on the same link.
    hsdp = StepCosts(block_fwd=1.0, block_bwd=1.0, head=0.0, optimizer=0.0, scatter=5.0, replicate=1.0)
    assert fsdp_step_ms(hsdp, num_layers=2) == pytest.approx(15.0)


def test_collective_and_tensor_parallel_costs():
    assert collective_ms(1e9, ranks=1, bus_gbps=100, latency_us=20) == 0.0
    assert collective_ms(1e9, ranks=2, bus_gbps=100, latency_us=0) == pytest.approx(5.0)
    assert collective_ms(1e9, ranks=4, bus_gbps=100, latency_us=10) == pytest.approx(7.5 + 0.03)
    assert allreduce_ms(1e9, ranks=2, bus_gbps=100, latency_us=0) == pytest.approx(10.0)
    # Half the compute each way, plus four exposed 5 ms collectives each way.
    assert tensor_parallel_block(8.0, 16.0, tp=2, activation_bytes=1e9, bus_gbps=100, latency_us=0) == \
        pytest.approx((24.0, 28.0))
    assert tensor_parallel_block(8.0, 16.0, tp=1, activation_bytes=1e9, bus_gbps=100, latency_us=0) == (8.0, 16.0)
    with pytest.raises(ValueError, match="num_layers and microbatches must be >= 1"):
        fsdp_step_ms(StepCosts(block_fwd=1.0, block_bwd=1.0, head=0.0, optimizer=0.0), num_layers=0)
