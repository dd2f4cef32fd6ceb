"""The chunked head cross-entropy equals the float32 full-logits loss and its gradients; the benchmark script
runs on CPU at the debug size and writes its JSON rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hola_titan.loss import (IGNORE_INDEX, auto_chunk_size, chunked_linear_cross_entropy,
                             naive_linear_cross_entropy)

ROOT = Path(__file__).resolve().parents[1]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.detach()
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-30))


def _case(num_rows: int, dim: int, vocab: int, dtype: torch.dtype, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(num_rows, dim, generator=gen) * 2.0).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (num_rows,), generator=gen)
    labels[torch.rand(num_rows, generator=gen) < 0.2] = IGNORE_INDEX
    return h, weight, labels


def _reference(h, weight, labels):
    """Float32 loss and gradients of the float32 copies of the inputs (the target of every comparison)."""
    h32 = h.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    loss = naive_linear_cross_entropy(h32, w32, labels)
    loss.backward()
    return loss.detach(), h32.grad, w32.grad


# Awkward shapes: rows not divisible by the chunk, a last chunk of one row, a chunk larger than N.
@pytest.mark.parametrize("num_rows,chunk", [(75, 16), (129, 64), (50, 0), (33, 100), (64, 1)])
def test_matches_float32_reference(num_rows, chunk):
    h, weight, labels = _case(num_rows, 24, 203, torch.float32)
    ref_loss, ref_dh, ref_dw = _reference(h, weight, labels)
    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=chunk)
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32
    assert _rel(loss, ref_loss) < 1e-5
    assert _rel(h.grad, ref_dh * 0.37) < 1e-5
    assert _rel(weight.grad, ref_dw * 0.37) < 1e-5


def test_all_ignored_chunks_give_zero_contribution():
    h, weight, labels = _case(96, 16, 101, torch.float32, seed=1)
    labels[:32] = IGNORE_INDEX  # the whole first chunk
    labels[64:] = IGNORE_INDEX  # and the last
    ref_loss, ref_dh, ref_dw = _reference(h, weight, labels)
    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=32)
    loss.backward()
    assert _rel(loss, ref_loss) < 1e-5
    assert _rel(h.grad, ref_dh) < 1e-5 and _rel(weight.grad, ref_dw) < 1e-5
    assert torch.equal(h.grad[:32], torch.zeros_like(h.grad[:32]))
    assert torch.equal(h.grad[64:], torch.zeros_like(h.grad[64:]))


def test_no_targets_at_all_is_zero_with_zero_gradients():
    h, weight, labels = _case(40, 8, 50, torch.float32, seed=2)
    labels.fill_(IGNORE_INDEX)
    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=16)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert not h.grad.any() and not weight.grad.any()


def test_bfloat16_inputs_match_float32_reference():
    """bf16 inputs: the loss equals the float32 reference of the same (bf16-valued) inputs to 1e-5; the gradients
    come back in bf16, so they must equal the float32 reference gradients rounded to bf16 (at most one bf16 ulp
    apart, where rounding of nearly-tied values can flip) and be far closer than bf16 matmuls get."""
    h, weight, labels = _case(150, 32, 257, torch.bfloat16, seed=3)
    ref_loss, ref_dh, ref_dw = _reference(h, weight, labels)
    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=64)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert _rel(loss, ref_loss) < 1e-5
    for grad, ref in ((h.grad, ref_dh), (weight.grad, ref_dw)):
        # Rounding to bf16 alone gives a relative error of about 2^-9; allow no more than that.
        assert _rel(grad, ref) <= _rel(ref.to(torch.bfloat16), ref) * 1.01 + 1e-7
        # Per element: one bf16 ulp, plus float32 summation-order noise where a sum cancels to nearly zero.
        ulp = ref.abs() * 2.0 ** -7 + 1e-5 * ref.abs().max()
        assert bool(((grad.float() - ref).abs() <= ulp).all())


def test_no_grad_and_detached_inputs_skip_gradients():
    h, weight, labels = _case(20, 8, 30, torch.float32, seed=4)
    ref_loss = naive_linear_cross_entropy(h.detach(), weight.detach(), labels)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=7)
    assert not loss.requires_grad and _rel(loss, ref_loss) < 1e-5


def test_bad_inputs_raise_value_error():
    h, weight, labels = _case(10, 8, 30, torch.float32)
    with pytest.raises(ValueError, match="width"):
        chunked_linear_cross_entropy(h, weight[:, :4], labels)
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(h, weight, labels[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(h, weight, labels, chunk_size=-1)


def test_auto_chunk_size_bounds_the_logits():
    assert auto_chunk_size(10, 32000) == 10
    rows = auto_chunk_size(1 << 20, 32000)
    assert rows % 128 == 0 and rows * 32000 * 4 <= 1 << 28


def test_bench_script_runs_on_cpu_and_writes_rows(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--device", "cpu", "--sizes", "debug",
           "--flavours", "hola,transformer", "--seq-lens", "64", "--batch-sizes", "2", "--steps", "2",
           "--warmup", "1", "--out", str(out)]
    for _ in range(2):  # the second call appends
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    ours = [r for r in rows if r["system"] == "hola_titan"]
    assert len(ours) == 4, rows
    for row in ours:
        for key in ("flavour", "size", "seq_len", "batch_size", "tokens_per_s", "mfu", "peak_memory_gib",
                    "step_ms", "forward_ms", "backward_ms", "optimizer_ms", "num_params", "device", "date"):
            assert key in row, key
        # The throughput is the step time's: tokens per step over seconds per step (bounds, not just > 0).
        tokens = row["seq_len"] * row["batch_size"]
        assert 0 < row["step_ms"] < 60_000
        assert row["tokens_per_s"] == pytest.approx(tokens * 1e3 / row["step_ms"], rel=1e-9)
        # Each timed step's own time: as many as steps, adding up to the timed window (marks between the ends).
        assert len(row["step_ms_each"]) == 2 and sum(row["step_ms_each"]) <= 2 * row["step_ms"] * (1 + 1e-6)
        assert row["step_max_over_median"] == pytest.approx(max(row["step_ms_each"]) / row["step_ms_median"])
        assert 0 < row["mfu"] < 1
    assert "reference models skipped" in result.stdout


def test_bf16_matmuls_match_the_unchunked_bf16_head():
    """``matmul_dtype=bfloat16``: the same loss as logits from a bf16 matmul then a float32 cross-entropy (what
    the unchunked head computed under autocast), and gradients within bf16 rounding of the float32 reference."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(96, 32, generator=gen, requires_grad=True)
    w = (0.1 * torch.randn(50, 32, generator=gen)).requires_grad_()
    labels = torch.randint(0, 50, (96,), generator=gen)
    labels[::7] = -100
    loss = chunked_linear_cross_entropy(h, w, labels, chunk_size=40, matmul_dtype=torch.bfloat16)
    expected = torch.nn.functional.cross_entropy((h.bfloat16() @ w.bfloat16().t()).float(), labels,
                                                 ignore_index=-100, reduction="sum")
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-4)
    loss.backward()
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    naive_linear_cross_entropy(h_ref, w_ref, labels).backward()
    for got, ref in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):
        assert (got - ref).norm() / ref.norm() < 2e-2  # bf16 operands: about 3 significant digits
    with pytest.raises(ValueError, match="matmul_dtype"):
        chunked_linear_cross_entropy(h, w, labels, matmul_dtype=torch.int32)
