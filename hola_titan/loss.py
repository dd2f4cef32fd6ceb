"""Cross-entropy over the output head, in chunks of rows, without the full ``[N, V]`` logits.

Legend: ``N`` rows (tokens, ``B * T`` flattened), ``d`` model width, ``V`` vocabulary, ``c`` rows per chunk.

The plain loss ``F.cross_entropy(F.linear(h, W).float(), labels, reduction="sum")`` keeps the logits
``[N, V]`` (and, in backward, their gradient) alive: at ``N = 32768`` and ``V = 32000`` that is 4 GiB in float32
per tensor. Here each chunk of ``c`` rows computes its float32 logits ``[c, V]``, its part of the summed loss and,
in the same pass, its gradients with respect to ``h`` and ``W`` (the softmax minus the one-hot target, times
the other operand). Backward only scales the stored gradients by the incoming scalar gradient, so the head is
never recomputed and at most ``c x V`` logits exist at any time.

Three tiers, as elsewhere in the project: :class:`ChunkedLinearCrossEntropyFunction` (the
``autograd.Function``), :func:`chunked_linear_cross_entropy` (the checked public function) and
:func:`naive_linear_cross_entropy` (the unchunked float32 reference).

Precision: by default every matmul runs in float32 on float32 copies of the inputs (autocast off), so the loss
and the gradients equal the float32 reference up to summation order, for bfloat16 inputs as well. With
``matmul_dtype=torch.bfloat16`` (the trainer's choice for bf16 training on GPU) the three matmuls take bf16
operands with float32 accumulation, as the unchunked head under autocast did, while the log-softmax stays in
float32: true float32 matmuls run at a small fraction of the tensor-core rate. The gradients are returned in the
inputs' dtypes, as autograd requires.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hola_titan.data.packing import IGNORE_INDEX

# Auto chunk size: the rows whose float32 logits take about this many bytes (256 MiB).
AUTO_CHUNK_BYTES = 1 << 28


def auto_chunk_size(num_rows: int, vocab_size: int, *, bytes_per_logit: int = 4) -> int:
    """Rows per chunk so that one chunk's logits take about ``AUTO_CHUNK_BYTES``; a multiple of 128."""
    rows = max(1, AUTO_CHUNK_BYTES // (bytes_per_logit * vocab_size))
    if rows >= 128:
        rows -= rows % 128
    return max(1, min(num_rows, rows))


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """Summed cross-entropy of ``h @ W^T`` against ``labels``; gradients computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int, compute_grad: bool, matmul_dtype: torch.dtype, kernel: bool) -> torch.Tensor:
        with torch.autocast(device_type=h.device.type, enabled=False):
            loss, grad_h, grad_w = _chunked_loss_and_grads(h, weight, labels, chunk_size=chunk_size,
                                                           ignore_index=ignore_index, compute_grad=compute_grad,
                                                           matmul_dtype=matmul_dtype, kernel=kernel)
        if compute_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.compute_grad = compute_grad
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if not ctx.compute_grad:
            raise RuntimeError("chunked_linear_cross_entropy: backward through a loss computed without gradients")
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.float()
        grad_h = (grad_h * scale).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_w = (grad_w * scale).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None, None


def _chunked_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int,
                            ignore_index: int, compute_grad: bool, matmul_dtype: torch.dtype, kernel: bool = False):
    """Loss sum (float32 scalar) and, with ``compute_grad``, the float32 gradients of ``h`` and ``weight``.

    ``kernel``: the softmax statistics and the logit gradient by ``hola_titan/kernels/fused/cross_entropy.py`` on the
    ``matmul_dtype`` logits, in place (needs a low-precision ``matmul_dtype``); else :func:`_logit_grads`, its
    reference, on float32 copies of the logits."""
    if kernel:
        from hola_titan.kernels.fused.cross_entropy import cross_entropy_rows_
    num_rows = h.shape[0]
    weight_vd = weight.to(matmul_dtype)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if compute_grad else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if compute_grad else None
    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        labels_c = labels[start:end]
        h_cd = h[start:end].to(matmul_dtype)
        if kernel:
            # float32 accumulation rounded to matmul_dtype, as in the PyTorch form; overwritten by the gradient.
            dlogits_cv = h_cd @ weight_vd.t()
            loss = loss + cross_entropy_rows_(dlogits_cv, labels_c, ignore_index=ignore_index,
                                              write_grad=compute_grad).sum()
        else:
            loss_c, dlogits_cv = _logit_grads(h_cd @ weight_vd.t(), labels_c, ignore_index=ignore_index,
                                              compute_grad=compute_grad)
            loss = loss + loss_c
        if compute_grad:
            dlogits_cv = dlogits_cv.to(matmul_dtype)
            grad_h[start:end] = dlogits_cv @ weight_vd
            grad_w += (dlogits_cv.t() @ h_cd).float()
    return loss, grad_h, grad_w


def _logit_grads(logits_cv: torch.Tensor, labels_c: torch.Tensor, *, ignore_index: int, compute_grad: bool):
    """The PyTorch form for one chunk: (summed loss, float32 logit gradient or None) from its logits ``[c, V]``."""
    logits_cv = logits_cv.float()
    valid_c = labels_c != ignore_index
    # Ignored rows (also whole chunks of them) are masked, not skipped: skipping would read a flag from the device
    # per chunk and stall the host.
    lse_c = torch.logsumexp(logits_cv, dim=-1)
    safe_labels = torch.where(valid_c, labels_c, torch.zeros_like(labels_c))
    target_c = logits_cv.gather(1, safe_labels.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid_c, lse_c - target_c, torch.zeros_like(lse_c)).sum()
    if not compute_grad:
        return loss, None
    # d loss / d logits = softmax - one_hot(target) on valid rows, 0 on ignored rows; in place on the logits so that
    # one [c, V] buffer serves the whole chunk.
    dlogits_cv = logits_cv.sub_(lse_c.unsqueeze(1)).exp_()
    dlogits_cv.scatter_add_(1, safe_labels.unsqueeze(1), torch.full((labels_c.shape[0], 1), -1.0,
                                                                    dtype=torch.float32, device=logits_cv.device))
    dlogits_cv.masked_fill_(~valid_c.unsqueeze(1), 0.0)
    return loss, dlogits_cv


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                 chunk_size: int = 0, ignore_index: int = IGNORE_INDEX,
                                 matmul_dtype: torch.dtype = torch.float32, kernel: bool = False) -> torch.Tensor:
    """Summed cross-entropy of the logits ``h @ weight^T`` over the targets that are not ``ignore_index``.

    Args:
        h: final hidden states ``[N, d]`` (e.g. ``[B, T, d]`` flattened over ``B, T``), any float dtype.
        weight: output head ``[V, d]``.
        labels: target ids ``[N]`` (int64), ``ignore_index`` where no target.
        chunk_size: rows per chunk; 0 picks about 256 MiB of float32 logits per chunk.
        ignore_index: label value that marks rows without a target.
        matmul_dtype: operand dtype of the head's matmuls (float32 accumulation either way); see the module
            docstring.
        kernel: compute the softmax and the logit gradient with the Triton kernel of
            ``hola_titan.kernels.fused.cross_entropy`` (CUDA, or Triton's interpreter), in place on the low-precision
            logits; needs ``matmul_dtype`` bfloat16 or float16.

    Returns:
        A float32 scalar equal to ``F.cross_entropy(F.linear(h.float(), weight.float()), labels,
        ignore_index=ignore_index, reduction="sum")`` up to float32 summation order; 0 when no row has a target.
        Its backward gives ``h`` and ``weight`` gradients in their own dtypes.
    """
    if h.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"h must be [N, d] and weight [V, d]; got {tuple(h.shape)} and {tuple(weight.shape)}")
    if h.shape[1] != weight.shape[1]:
        raise ValueError(f"h has width {h.shape[1]} but weight {tuple(weight.shape)} has {weight.shape[1]}")
    if labels.shape != (h.shape[0],):
        raise ValueError(f"labels must be [N] = [{h.shape[0]}]; got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 or int32; got {labels.dtype}")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: auto); got {chunk_size}")
    if not h.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"h and weight must be floating point; got {h.dtype} and {weight.dtype}")
    if matmul_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"matmul_dtype must be float32, bfloat16 or float16; got {matmul_dtype}")
    if kernel and matmul_dtype == torch.float32:
        raise ValueError("kernel: the cross-entropy kernel works on bfloat16 or float16 logits; got matmul_dtype "
                         "float32")
    # The kernel keeps one chunk of logits in matmul_dtype, the PyTorch form in float32: the same bytes per chunk.
    chunk = chunk_size or auto_chunk_size(h.shape[0], weight.shape[0], bytes_per_logit=2 if kernel else 4)
    compute_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return ChunkedLinearCrossEntropyFunction.apply(h, weight, labels.long(), chunk, ignore_index, compute_grad,
                                                   matmul_dtype, kernel)


def naive_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The float32 reference: full logits ``[N, V]``, then ``F.cross_entropy(reduction="sum")``."""
    return F.cross_entropy(F.linear(h.float(), weight.float()), labels.long(), ignore_index=ignore_index,
                           reduction="sum")
