"""The causal short convolutions of q, k and v as one Triton kernel each way, with SiLU and document resets.

Shape legend: N tokens (``B * T`` flattened), C channels of each of q, k, v, K taps (4).

Math (per channel c, DESIGN §1, item 1; ``p_t`` the token's position in its document):
    z_t = sum_{s < K, s <= p_t} w[c, K-1-s] x_{t-s},   y_t = silu(z_t)
The PyTorch form (``hola_titan.models.layers.ShortConvolution``) is the reference these kernels are tested against,
and the path for everything they do not cover (a tail from an earlier call, decoding, context parallelism, tensor
parallel or converted projections).

Why a kernel. Under ``torch.compile`` the three convolutions split into a cat, shifted masked products and a
dweight reduction that move about 12x the bytes they need, and fla-core's ``causal_conv1d`` did no better
(measurements in docs/LOG.md). Here the input is the fused q|k|v projection ``x [N, 3C]`` (one matmul instead of
three), the forward reads each input once per tap (neighbouring taps hit the cache) and writes q, k and v as three
contiguous tensors (what the GDN kernels take, no split copies). The backward is two kernels: one recomputes the
pre-activation from the K shifted inputs, writes ``dz = dy silu'(z)`` and, from the same inputs, per-tile weight-
gradient partials that a fixed-order sum reduces (deterministic); the other gathers ``dx [N, 3C]`` (the fused
projection's gradient in one piece) from K shifted rows of dz. (A single backward kernel that recomputed dz at
every shift spilled registers and ran at about 9x its byte floor; the split costs one extra write and read of dz.)

Arithmetic in float32 from the input dtype; the output and ``dx`` in the input dtype, ``dweight`` in float32. One
launch configuration (no autotuning: the interpreter runs it, and a fresh machine does not re-tune).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# Token tile x channel tile. 64 x 128 bf16 tiles: 16 KiB per load, 12,288 programs at N = 32k, 3C = 3072.
BLOCK_T, BLOCK_C, NUM_WARPS = 64, 128, 4
_INTERPRET = dict(BT=16, BC=16, num_warps=1)

# Tests set this to fill every output buffer with NaN before the kernels run, so unwritten elements fail.
POISON_OUTPUTS = False


def _empty(*shape, dtype, device):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


if triton is not None:

    @triton.jit
    def _short_conv_pos(pos_ptr, rows, N, SEQ, HAS_POS: tl.constexpr):
        """Position in the document of flat token rows (``SEQ``-token rows are documents without positions)."""
        if HAS_POS:
            return tl.load(pos_ptr + rows, mask=(rows >= 0) & (rows < N), other=0)
        return rows % SEQ

    @triton.jit
    def _short_conv_pre(x_ptr, w_ptr, pos_r, rows, o_c, N, C3, K: tl.constexpr, BT: tl.constexpr,
                        BC: tl.constexpr):
        """Pre-activation z ``[BT, BC]`` (float32) at token rows ``rows`` whose positions are ``pos_r``."""
        b_z = tl.zeros([BT, BC], dtype=tl.float32)
        r_ok = (rows >= 0) & (rows < N)
        for s in tl.static_range(K):
            b_w = tl.load(w_ptr + o_c * K + (K - 1 - s)).to(tl.float32)
            ok = r_ok & (pos_r >= s)
            b_x = tl.load(x_ptr + (rows - s)[:, None] * C3 + o_c[None, :], mask=ok[:, None], other=0.0)
            b_z += b_x.to(tl.float32) * b_w[None, :]
        return b_z

    @triton.jit
    def _short_conv_out_ptr(q_ptr, k_ptr, v_ptr, which):
        """The q, k or v tensor (``which`` 0, 1, 2) that a channel tile belongs to."""
        if which == 0:
            ptr = q_ptr
        elif which == 1:
            ptr = k_ptr
        else:
            ptr = v_ptr
        return ptr

    @triton.jit(do_not_specialize=["N", "SEQ"])
    def _short_conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, yq_ptr, yk_ptr, yv_ptr, N, SEQ, C: tl.constexpr,
                               K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
        i_t = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        C3 = 3 * C
        rows = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        pos = _short_conv_pos(pos_ptr, rows, N, SEQ, HAS_POS)
        b_z = _short_conv_pre(x_ptr, w_ptr, pos, rows, o_c, N, C3, K, BT, BC)
        b_y = b_z * tl.sigmoid(b_z)
        which = (i_c * BC) // C
        y_ptr = _short_conv_out_ptr(yq_ptr, yk_ptr, yv_ptr, which)
        cc = o_c - which * C
        tl.store(y_ptr + rows[:, None] * C + cc[None, :], b_y.to(y_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None])

    @triton.jit(do_not_specialize=["N", "SEQ"])
    def _short_conv_bwd_dz_kernel(x_ptr, w_ptr, pos_ptr, dyq_ptr, dyk_ptr, dyv_ptr, dz_ptr, dwp_ptr, N, SEQ,
                                  C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                                  BC: tl.constexpr, HAS_POS: tl.constexpr):
        """dz = dy silu'(z) at this tile's rows (z recomputed from the K shifted inputs, which also give this
        tile's dweight partial: dweight[c, K-1-s] = sum_t dz_t x_{t-s} over taps inside the document)."""
        i_t = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        C3 = 3 * C
        rows = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        which = (i_c * BC) // C
        dy_ptr = _short_conv_out_ptr(dyq_ptr, dyk_ptr, dyv_ptr, which)
        cc = o_c - which * C
        r_ok = rows < N
        pos = _short_conv_pos(pos_ptr, rows, N, SEQ, HAS_POS)
        b_z = _short_conv_pre(x_ptr, w_ptr, pos, rows, o_c, N, C3, K, BT, BC)
        b_dy = tl.load(dy_ptr + rows[:, None] * C + cc[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
        b_sig = tl.sigmoid(b_z)
        b_dz = b_dy * b_sig * (1.0 + b_z * (1.0 - b_sig))
        tl.store(dz_ptr + rows[:, None] * C3 + o_c[None, :], b_dz.to(dz_ptr.dtype.element_ty), mask=r_ok[:, None])
        for s in tl.static_range(K):
            ok = r_ok & (pos >= s)
            b_x = tl.load(x_ptr + (rows - s)[:, None] * C3 + o_c[None, :], mask=ok[:, None], other=0.0)
            tl.store(dwp_ptr + (i_t * C3 + o_c) * KP + (K - 1 - s), tl.sum(b_dz * b_x.to(tl.float32), axis=0))

    @triton.jit(do_not_specialize=["N", "SEQ"])
    def _short_conv_bwd_dx_kernel(dz_ptr, w_ptr, pos_ptr, dx_ptr, N, SEQ, C3: tl.constexpr, K: tl.constexpr,
                                  BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
        """dx_t = sum_s w[K-1-s] dz_{t+s} over the taps s that stay inside the document of row t + s."""
        i_t = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        rows = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        b_dx = tl.zeros([BT, BC], dtype=tl.float32)
        for s in tl.static_range(K):
            r = rows + s
            pos_r = _short_conv_pos(pos_ptr, r, N, SEQ, HAS_POS)
            keep = (r < N) & (pos_r >= s)
            b_w = tl.load(w_ptr + o_c * K + (K - 1 - s)).to(tl.float32)
            b_dz = tl.load(dz_ptr + r[:, None] * C3 + o_c[None, :], mask=keep[:, None], other=0.0)
            b_dx += b_dz.to(tl.float32) * b_w[None, :]
        tl.store(dx_ptr + rows[:, None] * C3 + o_c[None, :], b_dx.to(dx_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None])


def _launch_config(device: torch.device) -> dict:
    if device.type != "cuda":  # Triton's interpreter
        return dict(_INTERPRET)
    return dict(BT=BLOCK_T, BC=BLOCK_C, num_warps=NUM_WARPS)


def supports(channels: int, device: torch.device) -> bool:
    """Whether the kernels take ``channels`` per q, k and v on ``device`` (a multiple of the channel tile)."""
    bc = (BLOCK_C if torch.device(device).type == "cuda" else _INTERPRET["BC"])
    return triton is not None and channels % bc == 0


def _device_ctx(x: torch.Tensor):
    import contextlib
    return torch.cuda.device(x.device.index) if x.device.type == "cuda" else contextlib.nullcontext()


def _check(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None, bc: int) -> tuple[int, int]:
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, 3C], got shape {list(x.shape)}")
    c3 = x.shape[-1]
    if c3 % 3 or (c3 // 3) % bc:
        raise ValueError(f"x: the channels of each of q, k, v ({c3} / 3) must be a multiple of {bc}")
    if weight.dim() != 2 or weight.shape[0] != c3:
        raise ValueError(f"weight: expected [{c3}, K], got shape {list(weight.shape)}")
    if positions is not None and positions.numel() != x.shape[0] * x.shape[1]:
        raise ValueError(f"positions: expected {x.shape[0] * x.shape[1]} entries, got {positions.numel()}")
    return c3 // 3, weight.shape[1]


@torch.library.custom_op("hola::short_conv_fwd", mutates_args=())
def short_conv_fwd_op(x: torch.Tensor, weight: torch.Tensor,
                      positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` each ``[B, T, C]`` from ``x [B, T, 3C]``, ``weight [3C, K]``, ``positions [B, T]`` or None."""
    cfg = _launch_config(x.device)
    bt, bc = cfg.pop("BT"), cfg.pop("BC")
    c, k = _check(x, weight, positions, bc)
    bsz, seq_len, _ = x.shape
    n = bsz * seq_len
    x = x.contiguous()
    outs = [_empty(bsz, seq_len, c, dtype=x.dtype, device=x.device) for _ in range(3)]
    pos = positions.reshape(-1).contiguous() if positions is not None else x  # never read without positions
    if n:
        with _device_ctx(x):
            _short_conv_fwd_kernel[(triton.cdiv(n, bt), 3 * c // bc)](
                x, weight.contiguous(), pos, *outs, n, seq_len, C=c, K=k, BT=bt, BC=bc,
                HAS_POS=positions is not None, **cfg)
    return tuple(outs)


@short_conv_fwd_op.register_fake
def _(x, weight, positions):
    bsz, seq_len, c3 = x.shape
    return tuple(x.new_empty(bsz, seq_len, c3 // 3) for _ in range(3))


@torch.library.custom_op("hola::short_conv_bwd", mutates_args=())
def short_conv_bwd_op(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None, dq: torch.Tensor,
                      dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [B, T, 3C] in x's dtype, dweight [3C, K] float32)``."""
    cfg = _launch_config(x.device)
    bt, bc = cfg.pop("BT"), cfg.pop("BC")
    c, k = _check(x, weight, positions, bc)
    bsz, seq_len, c3 = x.shape
    n = bsz * seq_len
    kp = triton.next_power_of_2(k)
    tiles = triton.cdiv(n, bt)
    dx = _empty(bsz, seq_len, c3, dtype=x.dtype, device=x.device)
    # dz in the input dtype, as the PyTorch form's silu backward; the weight-gradient partials in float32.
    dz = _empty(bsz, seq_len, c3, dtype=x.dtype, device=x.device)
    partial = _empty(max(tiles, 1), c3, kp, dtype=torch.float32, device=x.device)
    pos = positions.reshape(-1).contiguous() if positions is not None else x
    if n:
        x, weight = x.contiguous(), weight.contiguous()
        has_pos = positions is not None
        with _device_ctx(x):
            _short_conv_bwd_dz_kernel[(tiles, c3 // bc)](
                x, weight, pos, dq.contiguous(), dk.contiguous(), dv.contiguous(), dz, partial, n, seq_len, C=c,
                K=k, KP=kp, BT=bt, BC=bc, HAS_POS=has_pos, **cfg)
            _short_conv_bwd_dx_kernel[(tiles, c3 // bc)](dz, weight, pos, dx, n, seq_len, C3=c3, K=k, BT=bt, BC=bc,
                                                         HAS_POS=has_pos, **cfg)
        dweight = partial[:tiles, :, :k].sum(0)
    else:
        dweight = torch.zeros(c3, k, dtype=torch.float32, device=x.device)
    return dx, dweight


@short_conv_bwd_op.register_fake
def _(x, weight, positions, dq, dk, dv):
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    x, weight, positions = inputs
    ctx.save_for_backward(x, weight, positions)
    ctx.weight_dtype = weight.dtype


def _backward(ctx, dq, dk, dv):
    x, weight, positions = ctx.saved_tensors
    grads = [g if g is not None else x.new_zeros(x.shape[0], x.shape[1], x.shape[2] // 3) for g in (dq, dk, dv)]
    dx, dweight = short_conv_bwd_op(x, weight, positions, *grads)
    return dx, dweight.to(ctx.weight_dtype), None


torch.library.register_autograd("hola::short_conv_fwd", _backward, setup_context=_setup)


def short_conv_qkv(x: torch.Tensor, weights: list[torch.Tensor], *,
                   positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(causal depthwise conv)`` of the fused q|k|v projection, restarting at every document start.

    Args:
        x: ``[B, T, 3C]``, the q, k and v projections side by side (any float dtype; the outputs take it).
        weights: the three convolution weights ``[C, 1, K]`` (or ``[C, K]``) of q, k and v.
        positions: ``[B, T]`` position of every token in its document, or None when every row is one document.

    Returns:
        ``(q, k, v)``, each ``[B, T, C]`` contiguous. Differentiable in ``x`` and the weights.
    """
    if triton is None:
        raise RuntimeError("short_conv_qkv needs Triton")
    weight = torch.cat([w.reshape(w.shape[0], -1) for w in weights])
    return short_conv_fwd_op(x, weight, positions)
