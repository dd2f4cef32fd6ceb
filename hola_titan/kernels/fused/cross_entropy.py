"""Row-wise cross-entropy and its logit gradient in one Triton kernel, in place on low-precision logits.

Shape legend: R rows (tokens of one chunk of the head, see ``hola_titan.loss``), V vocabulary.

For logits ``x [R, V]`` (bf16 or fp16, the head matmul's output) and targets ``y [R]``:
    lse_r = log sum_v exp(x_rv),   loss_r = lse_r - x_{r, y_r},   dx_rv = exp(x_rv - lse_r) - [v == y_r]
with ``loss_r = 0`` and ``dx_r = 0`` on rows whose target is ``ignore_index``. Statistics in float32. The gradient
overwrites the logits (one buffer per chunk, as the PyTorch path does with its float32 logits).

Why a kernel: the PyTorch form makes float32 logits and then passes over them six times (upcast, logsumexp, subtract,
exp, scatter, mask, downcast), several times the bytes the job needs (measurements in docs/LOG.md). This kernel
reads each row twice and writes it once in the logits' own dtype. The PyTorch
form (``hola_titan.loss._chunked_loss_and_grads`` without ``kernel``) is the reference it is tested against.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

BLOCK_V, NUM_WARPS = 4096, 8
_INTERPRET = dict(BV=64, num_warps=1)

if triton is not None:

    @triton.jit(do_not_specialize=["V", "IGNORE"])
    def _xent_rows_kernel(x_ptr, y_ptr, loss_ptr, V, IGNORE, WRITE_GRAD: tl.constexpr, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * V
        b_m = tl.full([BV], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BV], dtype=tl.float32)
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            b_x = tl.load(base + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
            b_new = tl.maximum(b_m, b_x)
            # Lanes still at -inf (a short last tile) keep l = 0: shift by 0 there, not by -inf (NaN).
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_l = b_l * tl.exp(b_m - b_ref) + tl.exp(b_x - b_ref)
            b_m = b_new
        m = tl.max(b_m, axis=0)
        lse = m + tl.log(tl.sum(b_l * tl.exp(b_m - m), axis=0))
        label = tl.load(y_ptr + row)
        valid = label != IGNORE
        safe = tl.where(valid, label, 0)
        x_t = tl.load(base + safe).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
        if WRITE_GRAD:
            for v0 in range(0, V, BV):
                o_v = v0 + tl.arange(0, BV)
                b_x = tl.load(base + o_v, mask=o_v < V, other=0.0).to(tl.float32)
                b_p = tl.exp(b_x - lse) - (o_v == safe).to(tl.float32)
                b_p = tl.where(valid, b_p, 0.0)
                tl.store(base + o_v, b_p.to(x_ptr.dtype.element_ty), mask=o_v < V)


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
                        write_grad: bool) -> torch.Tensor:
    """Per-row loss ``[R]`` (float32) of ``logits [R, V]``; with ``write_grad`` the logits are overwritten by
    ``softmax - one_hot`` (zero on ignored rows). ``logits`` must be contiguous bf16 or fp16; ``labels`` int64."""
    if triton is None:
        raise RuntimeError("cross_entropy_rows_ needs Triton")
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits: expected a contiguous [R, V] tensor, got shape {list(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"logits: expected bfloat16 or float16, got {logits.dtype}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels: expected shape [{logits.shape[0]}], got {list(labels.shape)}")
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    cfg = dict(_INTERPRET) if logits.device.type != "cuda" else dict(BV=BLOCK_V, num_warps=NUM_WARPS)
    if rows:
        ctx = torch.cuda.device(logits.device.index) if logits.device.type == "cuda" else _null()
        with ctx:
            _xent_rows_kernel[(rows,)](logits, labels.contiguous(), loss, vocab, ignore_index,
                                       WRITE_GRAD=write_grad, **cfg)
    return loss


def _null():
    import contextlib
    return contextlib.nullcontext()
