"""The ``"fa4"`` backend of ``hola_attention``: the cache read as one FlashAttention-4 varlen call per layer.

Shape legend: B batch, T tokens, H heads, D head dim, NB block rows of the batch's table, W window, C block,
S = W + C key slots per block row.

FlashAttention-4 (the ``flash-attn-4`` package, ``flash_attn.cute``: CuTe DSL kernels compiled at run time by
``nvidia-cutlass-dsl``, no CUDA toolchain at install; ``pip install 'hola-titan[fa4]'``) takes variable-length
sequences with a learnable sink logit per head and a causal mask aligned to the bottom right when a sequence has
more keys than queries. HOLA's read is exactly that, one sequence per block:

* queries: the block's own rows of ``qc = RMSNorm_{gamma_q}(q)``, in place (blocks tile the tokens in order, so
  ``cu_seqlens_q`` is the running sum of the block lengths and nothing is copied);
* keys and values: the block's ``n`` valid cache entries (``n = min(W, tokens of its document before it)``, the
  same for every head) followed by the block's own rows of ``kc = RMSNorm_{gamma_k}(k)`` and ``v``, gathered per
  head into ``S`` slots per block row (``cu_seqlens_k`` = multiples of ``S``, static, so no host
  synchronisation; ``seqused_k`` = ``n`` + the block's length). With ``n`` keys before the block's own, the
  bottom-right causal mask lets query ``i`` see the ``n`` cache keys and the block's keys ``0 ... i``: the
  visible set of the spec;
* the sink: ``learnable_sink`` (its logit in the softmax denominator, a zero value), scale ``D^-1/2``.

The gathered copy is ``NB * S`` rows of K and V (1.25x the tokens at W 64, C 256); the gradients of the gathered
rows go back to their tokens through the gather's own backward (an indexed sum). The RMSNorms run in float32 and
are rounded to the input dtype, and ``sigmoid(gate) o_cache`` is added to the state read in the input dtype, as
the SDPA backend does. State path and selection are the Triton backend's (fla's chunk op, the selection kernels);
on a CPU the fp32 reference state path and the torch selection stand in (tests), with the attention given as
``attend`` (:func:`varlen_attention_torch`, the FA4 call's semantics in PyTorch).

The FA4 call is wrapped in the custom ops ``hola::fa4_varlen`` and ``hola::fa4_varlen_bwd`` (FA4's own forward
and backward entry points, of the pinned version), so that a compiled block neither traces into CuTe DSL nor
breaks its graph there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hola_titan.kernels.hola_reference import merge_read, rms_norm
from hola_titan.kernels.hola_stages import final_cache_from_selection, state_and_table
from hola_titan.kernels.hola_triton_select import BlockTable

FA4_VERSION = "4.0.0b40"
"""The flash-attn-4 release this adapter is written and tested against (its private forward and backward entry
points change between releases; pyproject's ``fa4`` extra pins it and the packages it needs)."""
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the adapter offers: FA4 takes 8-256 in multiples of 8 on sm_90; these are the kernels' own."""


# ------------------------------------------------------------------------------------------------ availability


@functools.lru_cache(maxsize=None)
def fa4_version() -> str | None:
    """The installed flash-attn-4's version, or None."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _import_problem() -> str | None:
    """Why ``flash_attn.cute`` does not import (None when it does); once per process."""
    found = fa4_version()
    if found is None:
        return "flash-attn-4 is not installed (pip install 'hola-titan[fa4]')"
    if found != FA4_VERSION:
        return f"flash-attn-4 {found} is installed; the adapter is written against {FA4_VERSION}"
    try:
        from flash_attn.cute import interface  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure of an optional extra: the reason, not a crash
        return f"flash_attn.cute does not import ({type(exc).__name__}: {exc})"
    return None


def fa4_problem(device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why the FA4 read cannot run on ``device`` for ``head_dim`` and ``dtype`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "the FlashAttention-4 read needs a CUDA device"
    if torch.version.hip is not None:
        return "FlashAttention-4's Hopper kernels are NVIDIA's (this is a ROCm build)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"the adapter is written for FlashAttention-4's sm_90 kernels; this GPU is sm_{major}{minor}"
    if head_dim is not None and head_dim not in FA4_HEAD_DIMS:
        return f"head dim {head_dim} is not one of {FA4_HEAD_DIMS}"
    if dtype is not None and dtype not in FA4_DTYPES:
        return f"FlashAttention-4 takes bfloat16 or float16 inputs, not {dtype}"
    return _import_problem()


# ------------------------------------------------------------------------------------------------ the layout


@dataclass
class VarlenLayout:
    """Where every query and key slot of the varlen call comes from (all on the inputs' device).

    ``key_rows`` ``[NB * S, H]`` int64: the token row each key slot reads, per head (``num_tokens``, an appended
    zero row, for slots past a block's keys). ``cu_q`` ``[NB + 1]`` and ``cu_k`` ``[NB + 1]`` int32 offsets,
    ``used_k`` ``[NB]`` int32 keys per block row; ``max_q = C``, ``max_k = S``.
    """

    key_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    max_q: int
    max_k: int


def varlen_layout(sel: torch.Tensor, table: BlockTable, *, num_tokens: int, window: int, block: int) -> VarlenLayout:
    """The layout of :class:`VarlenLayout` for the selection ``sel`` ``[NB, H, W]`` (flat token indices, ``-1``
    empty) and the block ``table``. Tensor operations only: no host synchronisation, traceable."""
    device = sel.device
    nb, h = table.num_blocks, sel.shape[1]
    slots = window + block
    blk_len = table.blk_len.long()
    # Valid entries first, in the selection's order (a stable sort on emptiness); their number is the same for
    # every head (each head picks its top W among the same earlier tokens of the document), so head 0 gives it.
    if window > 0:
        order = (sel < 0).to(torch.int8).argsort(dim=-1, stable=True)
        cached = sel.gather(-1, order).long()  # [NB, H, W]
        n_valid = (cached[:, 0] >= 0).sum(-1)  # [NB]
    else:
        cached = sel.new_empty(nb, h, 0).long()
        n_valid = torch.zeros(nb, dtype=torch.int64, device=device)
    pos = torch.arange(slots, device=device)  # [S]
    in_block = pos[None, :] - n_valid[:, None]  # [NB, S]: a slot's row within the block, when >= 0
    own = (in_block >= 0) & (in_block < blk_len[:, None])
    block_rows = table.blk_start.long()[:, None] + in_block.clamp_min(0)
    rows = torch.where(own, block_rows, torch.full_like(block_rows, num_tokens))  # [NB, S]
    rows = rows[:, :, None].expand(nb, slots, h)
    if window > 0:  # the first n_valid slots of every block row read its cache entries, per head
        from_cache = (pos[None, :window] < n_valid[:, None])[:, :, None]  # [NB, W, 1]
        rows = torch.cat([torch.where(from_cache, cached.transpose(1, 2), rows[:, :window]), rows[:, window:]], 1)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.cat([zero, torch.cumsum(blk_len, 0).to(torch.int32)])
    cu_k = torch.arange(nb + 1, dtype=torch.int32, device=device) * slots
    used_k = (n_valid + blk_len).to(torch.int32)
    return VarlenLayout(key_rows=rows.reshape(nb * slots, h), cu_q=cu_q, cu_k=cu_k, used_k=used_k, max_q=block,
                        max_k=slots)


# ------------------------------------------------------------------------------------------------ the attention


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, layout: VarlenLayout,
                           scale: float) -> torch.Tensor:
    """What the FA4 call computes, in PyTorch (float32 softmax, the result in ``q``'s dtype): sequence ``b`` has
    the queries ``q[cu_q[b]:cu_q[b+1]]`` and the keys ``k[cu_k[b]:cu_k[b] + used_k[b]]``; query ``i`` sees keys
    ``j <= i + used_k[b] - len_q[b]`` (causal, aligned to the bottom right), and ``sink[h]`` joins every row's
    softmax denominator with a zero value. Rows of ``q`` outside every sequence are zero. The oracle the FA4
    kernels are checked against, and the ``attend`` of CPU tests."""
    total_q, h, d = q.shape
    nseq = layout.cu_q.shape[0] - 1
    device = q.device
    start_q, len_q = layout.cu_q[:-1].long(), (layout.cu_q[1:] - layout.cu_q[:-1]).long()
    start_k, len_k = layout.cu_k[:-1].long(), layout.used_k.long()
    iq, ik = torch.arange(layout.max_q, device=device), torch.arange(layout.max_k, device=device)
    ok_q = iq[None, :] < len_q[:, None]  # [N, Lq]
    ok_k = ik[None, :] < len_k[:, None]  # [N, Lk]
    rows_q = torch.where(ok_q, start_q[:, None] + iq[None, :], torch.zeros_like(ok_q, dtype=torch.long))
    rows_k = torch.where(ok_k, start_k[:, None] + ik[None, :], torch.zeros_like(ok_k, dtype=torch.long))
    qs, ks, vs = q[rows_q].float(), k[rows_k].float(), v[rows_k].float()  # [N, L, H, D]
    logits = torch.einsum("nqhd,nkhd->nhqk", qs, ks) * scale
    shift = (len_k - len_q)[:, None, None]
    visible = ok_k[:, None, :] & (ik[None, None, :] <= iq[None, :, None] + shift)  # [N, Lq, Lk]
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    with_sink = torch.cat([logits, sink.float().view(1, h, 1, 1).expand(nseq, h, layout.max_q, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    out = torch.einsum("nhqk,nkhd->nqhd", probs, vs).to(q.dtype)  # [N, Lq, H, D]
    flat = torch.zeros(total_q + 1, h, d, dtype=q.dtype, device=device)
    return flat.index_put((torch.where(ok_q, rows_q, torch.full_like(rows_q, total_q)),), out)[:total_q]


@torch.library.custom_op("hola::fa4_varlen", mutates_args=())
def fa4_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, used_k: torch.Tensor, max_q: int, max_k: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [total_q, H, D], lse [H, total_q] float32)`` of FA4's varlen forward (causal, bottom right, with the
    sink)."""
    from flash_attn.cute.interface import _flash_attn_fwd
    out, lse, *_ = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                   max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=True,
                                   learnable_sink=sink, return_lse=True)
    return out, lse


@fa4_varlen_op.register_fake
def _(q, k, v, sink, cu_q, cu_k, used_k, max_q, max_k, scale):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("hola::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, sink: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      used_k: torch.Tensor, max_q: int, max_k: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsink)`` of FA4's varlen backward."""
    from flash_attn.cute.interface import _flash_attn_bwd
    dq, dk, dv, dsink = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True, cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, seqused_k=used_k, max_seqlen_q=max_q,
                                        max_seqlen_k=max_k, learnable_sink=sink)
    return dq, dk, dv, dsink


@fa4_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, sink, cu_q, cu_k, used_k, max_q, max_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sink)


def _fa4_setup(ctx, inputs, output):
    q, k, v, sink, cu_q, cu_k, used_k, max_q, max_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sink, cu_q, cu_k, used_k, out, lse)
    ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale


def _fa4_backward(ctx, dout, _dlse):
    q, k, v, sink, cu_q, cu_k, used_k, out, lse = ctx.saved_tensors
    dq, dk, dv, dsink = fa4_varlen_bwd_op(dout, q, k, v, out, lse, sink, cu_q, cu_k, used_k, ctx.max_q, ctx.max_k,
                                          ctx.scale)
    return dq, dk, dv, dsink, None, None, None, None, None, None


fa4_varlen_op.register_autograd(_fa4_backward, setup_context=_fa4_setup)


def varlen_attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, layout: VarlenLayout,
                         scale: float) -> torch.Tensor:
    """:func:`varlen_attention_torch`'s function on FlashAttention-4's sm_90 kernels (the sink in float32)."""
    out, _ = fa4_varlen_op(q.contiguous(), k.contiguous(), v.contiguous(), sink.float().contiguous(), layout.cu_q,
                           layout.cu_k, layout.used_k, layout.max_q, layout.max_k, float(scale))
    return out


# ------------------------------------------------------------------------------------------------ the backend


def hola_attention_fa4(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                       cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                       output_final_cache: bool = False, selected: torch.Tensor | None = None,
                       return_aux: bool = False, state_impl: str = "auto", chunk_indices: torch.Tensor | None = None,
                       block_table: BlockTable | None = None, scale: float | None = None, mix: str = "sum",
                       attend=varlen_attention_fa4):
    """The FA4 backend; same arguments and results as ``hola_attention_sdpa``. ``attend``: the varlen attention
    (:func:`varlen_attention_fa4`; tests give :func:`varlen_attention_torch` to check the layout on a CPU)."""
    bsz, seq_len, h, d = q.shape
    dtype, device = q.dtype, q.device
    o_state, m, final_state, table = state_and_table(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
        impl=state_impl, chunk_indices=chunk_indices, scale=scale, evict=evict, block=block, block_table=block_table)
    aux = {"m": m}
    if table is None:  # evict "none": GDN, no cache read
        return (o_state, final_state, None, aux) if return_aux else (o_state, final_state, None)
    num_tokens = bsz * seq_len
    m_flat = m.reshape(num_tokens, h)
    final_keys = None
    if selected is not None:
        sel = selected.to(device=device, dtype=torch.int32)
    elif device.type == "cuda":
        from hola_titan.kernels.hola_stages import select
        sel, final_keys = select(m_flat, table, window=window, evict=evict, num_heads=h)
    else:  # CPU tests: the selection in torch (the Triton kernels need a GPU or the interpreter)
        from hola_titan.kernels.hola_sdpa import _select
        sel = _select(m_flat, table, window=window, evict=evict, num_heads=h)
    layout = varlen_layout(sel, table, num_tokens=num_tokens, window=window, block=block)
    qc = rms_norm(q.float(), gamma_q.float()).to(dtype).reshape(num_tokens, h, d)
    kc = rms_norm(k.float(), gamma_k.float()).to(dtype).reshape(num_tokens, h, d)
    heads = torch.arange(h, device=device)

    def gathered(x):  # [B*T, H, D] -> [NB*S, H, D]; the appended zero row fills the unused slots
        return torch.cat([x, x.new_zeros(1, h, d)])[layout.key_rows, heads[None, :]]

    o_cache = attend(qc, gathered(kc), gathered(v.reshape(num_tokens, h, d)), sink, layout, d ** -0.5)
    lam = torch.sigmoid(gate.float()).to(dtype)
    o = merge_read(o_state, lam.view(1, 1, h, 1) * o_cache.view(bsz, seq_len, h, d), mix)
    final_cache = None
    if output_final_cache:
        if final_keys is None and evict == "score" and selected is None and window > 0:
            from hola_titan.kernels.hola_sdpa import _final_keys
            from hola_titan.kernels.hola_triton_select import score_keys
            final_keys = _final_keys(m_flat, table, window, score_keys)
        final_cache = final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table, window=window, block=block,
                                                 evict=evict)
    aux.update(sel=sel, table=table)
    return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)


__all__ = ["hola_attention_fa4", "fa4_problem", "varlen_attention_torch", "varlen_attention_fa4", "varlen_layout"]
