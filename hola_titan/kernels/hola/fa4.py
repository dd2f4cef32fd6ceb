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
rows go back to their tokens through the gather's own backward (``index_add_`` in float32,
:func:`~hola_titan.kernels.hola.stages.gather_head_rows`). The RMSNorms run in float32 and
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

from hola_titan.kernels.hola.reference import merge_read, rms_norm
from hola_titan.kernels.hola.stages import final_cache_from_selection, gather_head_rows, state_and_table
from hola_titan.kernels.runtime.documents import BlockTable

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
    """Where every query and key slot of one varlen call comes from (all on the inputs' device).

    ``key_rows`` ``[NB * S, H]`` int64: the token row each key slot reads, per head (``num_tokens`` for slots past
    a sequence's keys: they read zeros, and their gradients, which FlashAttention-4's backward leaves unwritten, are
    dropped by :func:`~hola_titan.kernels.hola.stages.gather_head_rows`); None when the keys are the token rows
    themselves, in place.
    ``cu_q`` and ``cu_k`` ``[NB + 1]`` int32 offsets, ``used_k`` ``[NB]`` int32 keys per sequence (None: all of
    ``cu_k``'s), ``max_q`` / ``max_k`` their bounds; ``causal``: the mask aligned to the bottom right, else none.
    """

    key_rows: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor | None
    max_q: int
    max_k: int
    causal: bool = True


def _cache_slots(sel: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cached [NB, H, W] int64, n_valid [NB])``: every block's valid entries first, in the selection's order (a
    stable sort on emptiness), and their number, which is the same for every head (each head picks its top W among
    the same earlier tokens of the document), so head 0 gives it."""
    if window == 0:
        return sel.new_empty(sel.shape[0], sel.shape[1], 0).long(), sel.new_zeros(sel.shape[0]).long()
    order = (sel < 0).to(torch.int8).argsort(dim=-1, stable=True)
    cached = sel.gather(-1, order).long()
    return cached, (cached[:, 0] >= 0).sum(-1)


def _block_offsets(table: BlockTable) -> torch.Tensor:
    """``[NB + 1]`` int32: the running sum of the block lengths, i.e. each block's first token (blocks tile the tokens
    in order; the table's padding rows, of length 0, add nothing)."""
    zero = torch.zeros(1, dtype=torch.int32, device=table.blk_len.device)
    return torch.cat([zero, torch.cumsum(table.blk_len.long(), 0).to(torch.int32)])


def varlen_layout(sel: torch.Tensor, table: BlockTable, *, num_tokens: int, window: int, block: int) -> VarlenLayout:
    """One call (``layout="gathered"``): every block a sequence of its own rows as queries and, as keys, its cache
    entries followed by its own rows, gathered per head into ``S = W + C`` slots. ``sel`` ``[NB, H, W]`` (flat token
    indices, ``-1`` empty). Tensor operations only: no host synchronisation, traceable."""
    device = sel.device
    nb, h = table.num_blocks, sel.shape[1]
    slots = window + block
    blk_len = table.blk_len.long()
    cached, n_valid = _cache_slots(sel, window)
    pos = torch.arange(slots, device=device)  # [S]
    in_block = pos[None, :] - n_valid[:, None]  # [NB, S]: a slot's row within the block, when >= 0
    own = (in_block >= 0) & (in_block < blk_len[:, None])
    block_rows = table.blk_start.long()[:, None] + in_block.clamp_min(0)
    rows = torch.where(own, block_rows, torch.full_like(block_rows, num_tokens))  # [NB, S]
    rows = rows[:, :, None].expand(nb, slots, h)
    if window > 0:  # the first n_valid slots of every block row read its cache entries, per head
        from_cache = (pos[None, :window] < n_valid[:, None])[:, :, None]  # [NB, W, 1]
        rows = torch.cat([torch.where(from_cache, cached.transpose(1, 2), rows[:, :window]), rows[:, window:]], 1)
    cu_k = torch.arange(nb + 1, dtype=torch.int32, device=device) * slots
    return VarlenLayout(key_rows=rows.reshape(nb * slots, h), cu_q=_block_offsets(table), cu_k=cu_k,
                        used_k=(n_valid + blk_len).to(torch.int32), max_q=block, max_k=slots)


def split_layouts(sel: torch.Tensor, table: BlockTable, *, num_tokens: int, window: int,
                  block: int) -> tuple[VarlenLayout, VarlenLayout | None]:
    """Two calls (``layout="split"``), merged by their log-sum-exps: the blocks' own rows, causal, in place (no
    copy), and the cache entries alone, gathered per head into ``W`` slots per block, no mask (every query of a
    block sees all of its entries). The second is None without a window."""
    offsets = _block_offsets(table)
    own = VarlenLayout(key_rows=None, cu_q=offsets, cu_k=offsets, used_k=None, max_q=block, max_k=block)
    if window == 0:
        return own, None
    nb, h = table.num_blocks, sel.shape[1]
    cached, n_valid = _cache_slots(sel, window)
    slot_ok = torch.arange(window, device=sel.device)[None, :] < n_valid[:, None]  # [NB, W]
    rows = torch.where(slot_ok[:, :, None], cached.transpose(1, 2), torch.full_like(cached.transpose(1, 2),
                                                                                  num_tokens))
    cu_k = torch.arange(nb + 1, dtype=torch.int32, device=sel.device) * window
    return own, VarlenLayout(key_rows=rows.reshape(nb * window, h), cu_q=offsets, cu_k=cu_k,
                             used_k=n_valid.to(torch.int32), max_q=block, max_k=window, causal=False)


# ------------------------------------------------------------------------------------------------ the attention


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                           layout: VarlenLayout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FA4 call computes, in PyTorch (float32 softmax, the output in ``q``'s dtype): sequence ``b`` has the
    queries ``q[cu_q[b]:cu_q[b+1]]`` and the keys ``k[cu_k[b]:cu_k[b] + used_k[b]]``; with ``layout.causal`` query
    ``i`` sees keys ``j <= i + used_k[b] - len_q[b]`` (aligned to the bottom right), else all of them; ``sink[h]``
    (if given) joins every row's softmax denominator with a zero value. Returns ``(out [total_q, H, D], lse [H,
    total_q] float32)``, the log of each row's denominator (``-inf`` for a row that sees nothing and has no sink;
    its output is zero). Rows of ``q`` outside every sequence are zero. The oracle the FA4 kernels are checked
    against, and the ``attend`` of CPU tests."""
    total_q, h, d = q.shape
    nseq = layout.cu_q.shape[0] - 1
    device = q.device
    start_q, len_q = layout.cu_q[:-1].long(), (layout.cu_q[1:] - layout.cu_q[:-1]).long()
    start_k = layout.cu_k[:-1].long()
    len_k = (layout.cu_k[1:] - layout.cu_k[:-1]).long() if layout.used_k is None else layout.used_k.long()
    iq, ik = torch.arange(layout.max_q, device=device), torch.arange(layout.max_k, device=device)
    ok_q = iq[None, :] < len_q[:, None]  # [N, Lq]
    ok_k = ik[None, :] < len_k[:, None]  # [N, Lk]
    rows_q = torch.where(ok_q, start_q[:, None] + iq[None, :], torch.zeros_like(ok_q, dtype=torch.long))
    rows_k = torch.where(ok_k, start_k[:, None] + ik[None, :], torch.zeros_like(ok_k, dtype=torch.long))
    qs, ks, vs = q[rows_q].float(), k[rows_k].float(), v[rows_k].float()  # [N, L, H, D]
    logits = torch.einsum("nqhd,nkhd->nhqk", qs, ks) * scale
    visible = ok_k[:, None, :].expand(nseq, layout.max_q, layout.max_k)  # [N, Lq, Lk]
    if layout.causal:
        shift = (len_k - len_q)[:, None, None]
        visible = visible & (ik[None, None, :] <= iq[None, :, None] + shift)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.float().view(1, h, 1, 1).expand(nseq, h, layout.max_q, 1)], dim=-1)
    # A softmax that also takes rows seeing nothing (a block without cache entries in the split layout's second
    # call): their weights are 0 and their lse -inf, with finite gradients everywhere.
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    e = torch.exp(logits - top)
    total = e.sum(-1)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, torch.log(total) + top[..., 0], torch.full_like(total, float("-inf")))  # [N, H, Lq]
    probs = (e / total[..., None])[..., :layout.max_k]  # the sink's column carries no value
    out = torch.einsum("nhqk,nkhd->nqhd", probs, vs).to(q.dtype)  # [N, Lq, H, D]
    dest = torch.where(ok_q, rows_q, torch.full_like(rows_q, total_q))
    flat = torch.zeros(total_q + 1, h, d, dtype=q.dtype, device=device).index_put((dest,), out)[:total_q]
    flat_lse = torch.full((total_q + 1, h), float("-inf"), device=device).index_put((dest,), lse.transpose(1, 2))
    return flat, flat_lse[:total_q].t()


@torch.library.custom_op("hola::fa4_varlen", mutates_args=())
def fa4_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, used_k: torch.Tensor | None, max_q: int, max_k: int, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [total_q, H, D], lse [H, total_q] float32)`` of FA4's varlen forward."""
    from flash_attn.cute.interface import _flash_attn_fwd
    out, lse, *_ = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                   max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
                                   learnable_sink=sink, return_lse=True)
    return out, lse


@fa4_varlen_op.register_fake
def _(q, k, v, sink, cu_q, cu_k, used_k, max_q, max_k, scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("hola::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                      cu_q: torch.Tensor, cu_k: torch.Tensor, used_k: torch.Tensor | None, max_q: int, max_k: int,
                      scale: float, causal: bool,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsink)`` of FA4's varlen backward (``dsink`` empty without a sink); ``dlse``: the gradient of
    the returned log-sum-exp (the split layout's merge), or None; ``deterministic``: FA4's deterministic backward
    (its dq summed in a fixed order), as ``training.deterministic`` asks."""
    from flash_attn.cute.interface import _flash_attn_bwd
    result = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, causal, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, seqused_k=used_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                             deterministic=deterministic, dlse=None if dlse is None else dlse.contiguous(),
                             learnable_sink=sink)
    dq, dk, dv = result[:3]
    return dq, dk, dv, (result[3] if sink is not None else q.new_empty(0))


@fa4_varlen_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sink, cu_q, cu_k, used_k, max_q, max_k, scale, causal, deterministic):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0))


def _fa4_setup(ctx, inputs, output):
    q, k, v, sink, cu_q, cu_k, used_k, max_q, max_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sink, cu_q, cu_k, used_k, out, lse)
    ctx.max_q, ctx.max_k, ctx.scale, ctx.causal = max_q, max_k, scale, causal


def _fa4_backward(ctx, dout, dlse):
    q, k, v, sink, cu_q, cu_k, used_k, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # Read here, as the Triton kernels do: the trainer's training.deterministic sets it for the whole process.
    dq, dk, dv, dsink = fa4_varlen_bwd_op(dout, dlse, q, k, v, out, lse, sink, cu_q, cu_k, used_k, ctx.max_q,
                                          ctx.max_k, ctx.scale, ctx.causal,
                                          torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, (dsink if sink is not None else None), None, None, None, None, None, None, None


fa4_varlen_op.register_autograd(_fa4_backward, setup_context=_fa4_setup)


def varlen_attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                         layout: VarlenLayout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`varlen_attention_torch`'s function on FlashAttention-4's sm_90 kernels (the sink in float32)."""
    return fa4_varlen_op(q.contiguous(), k.contiguous(), v.contiguous(),
                         None if sink is None else sink.float().contiguous(), layout.cu_q, layout.cu_k,
                         layout.used_k, layout.max_q, layout.max_k, float(scale), layout.causal)


def merge_by_lse(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The softmax read over the union of two disjoint key sets, from each set's normalised read ``o`` ``[N, H, D]``
    and log-sum-exp ``lse`` ``[H, N]`` (float32; ``-inf`` where a set is empty, which then weighs nothing): the
    reads weighted by their share of the summed denominators. In float32, the result in ``o_a``'s dtype."""
    a, b = lse_a.t().unsqueeze(-1), lse_b.t().unsqueeze(-1)  # [N, H, 1]
    top = torch.maximum(a, b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(a - top), torch.exp(b - top)
    return ((o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)).to(o_a.dtype)


# ------------------------------------------------------------------------------------------------ the backend


def read_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma_q: torch.Tensor,
              gamma_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qc, kc, v)`` as ``[B*T, H, D]`` token rows: the cache path's RMSNorms in float32, rounded to the input
    dtype (as the SDPA backend forms them), and v as it is."""
    b, t, h, d = q.shape
    qc = rms_norm(q.float(), gamma_q.float()).to(q.dtype).reshape(b * t, h, d)
    kc = rms_norm(k.float(), gamma_k.float()).to(q.dtype).reshape(b * t, h, d)
    return qc, kc, v.reshape(b * t, h, d)


LAYOUTS = ("gathered", "split")
"""How the read is laid out for FA4: ``gathered``, one call over each block's cache entries and own rows copied
into ``W + C`` slots; ``split``, two calls merged by their log-sum-exps, the own rows in place and only the ``W``
entries copied. Which is faster end to end is a GPU measurement (``bench_hola_attention.py``: ``hola_fa4`` and
``hola_fa4_split``)."""


def hola_attention_fa4(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window: int, block: int, evict: str,
                       cu_seqlens=None, initial_state=None, output_final_state: bool = False,
                       output_final_cache: bool = False, selected: torch.Tensor | None = None,
                       return_aux: bool = False, state_impl: str = "auto", chunk_indices: torch.Tensor | None = None,
                       block_table: BlockTable | None = None, scale: float | None = None, mix: str = "sum",
                       layout: str = "gathered", attend=varlen_attention_fa4):
    """The FA4 backend; same arguments and results as ``hola_attention_sdpa``. ``layout``: one of :data:`LAYOUTS`.
    ``attend``: the varlen attention (:func:`varlen_attention_fa4`; tests give :func:`varlen_attention_torch` to
    check the layouts on a CPU)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: unknown {layout!r}; expected one of {LAYOUTS}")
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
        from hola_titan.kernels.hola.stages import select
        sel, final_keys = select(m_flat, table, window=window, evict=evict, num_heads=h)
    else:  # CPU tests: the selection in torch (the Triton kernels need a GPU or the interpreter)
        from hola_titan.kernels.hola.sdpa import _select
        sel = _select(m_flat, table, window=window, evict=evict, num_heads=h)
    qc, kc, vr = read_rows(q, k, v, gamma_q, gamma_k)
    if layout == "gathered":
        lay = varlen_layout(sel, table, num_tokens=num_tokens, window=window, block=block)
        o_cache, _ = attend(qc, gather_head_rows(kc, lay.key_rows), gather_head_rows(vr, lay.key_rows), sink, lay,
                            d ** -0.5)
    else:
        own, entries = split_layouts(sel, table, num_tokens=num_tokens, window=window, block=block)
        o_cache, lse_own = attend(qc, kc, vr, sink, own, d ** -0.5)
        if entries is not None:
            o_entries, lse_entries = attend(qc, gather_head_rows(kc, entries.key_rows),
                                            gather_head_rows(vr, entries.key_rows), None, entries, d ** -0.5)
            # A block without entries (its document's first) is a sequence with no keys: whatever the kernel leaves
            # in its rows, they weigh nothing.
            has = torch.repeat_interleave(entries.used_k > 0, table.blk_len.long(), output_size=num_tokens)
            o_entries = torch.where(has[:, None, None], o_entries, torch.zeros_like(o_entries))
            lse_entries = torch.where(has[None, :], lse_entries, torch.full_like(lse_entries, float("-inf")))
            o_cache = merge_by_lse(o_cache, lse_own, o_entries, lse_entries)
    lam = torch.sigmoid(gate.float()).to(dtype)
    o = merge_read(o_state, lam.view(1, 1, h, 1) * o_cache.view(bsz, seq_len, h, d), mix)
    final_cache = None
    if output_final_cache:
        if final_keys is None and evict == "score" and selected is None and window > 0:
            from hola_titan.kernels.hola.sdpa import _final_keys
            from hola_titan.kernels.hola.selection import score_keys
            final_keys = _final_keys(m_flat, table, window, score_keys)
        final_cache = final_cache_from_selection(q, k, v, m_flat, sel, final_keys, table, window=window, block=block,
                                                 evict=evict)
    aux.update(sel=sel, table=table)
    return (o, final_state, final_cache, aux) if return_aux else (o, final_state, final_cache)


__all__ = ["hola_attention_fa4", "fa4_problem", "merge_by_lse", "split_layouts", "varlen_attention_torch",
           "varlen_attention_fa4", "varlen_layout"]
