"""The language model: HOLA, HOLA+recency, GDN and Transformer++ from one block structure (DESIGN §1, 5).

``HolaTitanLM(args)`` is built on the meta device (:func:`build_model`; on a real device the ``nn`` layers would
draw their default init), sharded, materialised with ``to_empty`` and then initialised by ``init_weights``.
Blocks live in an ``nn.ModuleDict`` keyed by layer index, so fully qualified names are stable at every parallel
layout, e.g. ``layers.3.attn.q_proj.weight``. Model code never touches ``torch.distributed``.

Shape legend: B batch, T tokens, V vocabulary, H heads, D head dim. Packed rows (``cu_seqlens`` over the
flattened B*T stream, every row starting a document) reset the recurrent state, the HOLA cache, the short
convolutions and the Transformer++ attention at each document start (DESIGN §2, packed documents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.runtime.documents import Documents
from hola_titan.models.args import ModelArgs
from hola_titan.models.context import NO_CONTEXT, BatchContext
from hola_titan.models.layers import (FeedForward, RMSNorm, ShortConvolution, _is_plain_linear, apply_rope,
                                      document_ids, document_positions, LocalParams)
from hola_titan.ops import HolaSettings, hola_attention

INIT_STD = 0.02
NO_SINK = -1.0e4
"""The sink logit of a layer without a sink (``model.cache_sink`` false): exp(-1e4 - any score) is 0 in float32 and
float64, so the softmax is the one over the keys alone; finite, so no kernel meets inf - inf."""


@dataclass
class RecurrentLayerCache:
    """Decoding state of one HOLA/GDN layer: conv tails ``[B, K-1, H*D]``, state ``[B, H, D, D]``, HOLA cache.

    Its layout is public (:attr:`TENSORS`, then the HOLA cache's; :meth:`flatten`, :meth:`unflatten`,
    :meth:`map_tensors`, :meth:`stack_rows`): the static decoder's buffers, generation's row selection and the
    batching of prompts move it through these, without naming its parts."""

    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    state: torch.Tensor | None = None
    hola: HolaCache | None = None

    TENSORS = ("conv_q", "conv_k", "conv_v", "state")

    def flatten(self) -> list[torch.Tensor]:
        """Its tensors (batch rows first in each): :attr:`TENSORS`, then the HOLA cache's, if any."""
        return [getattr(self, name) for name in self.TENSORS] + (self.hola.flatten() if self.hola is not None else [])

    def meta(self) -> dict | None:
        """What :meth:`unflatten` needs besides the tensors: the HOLA cache's settings (None: no HOLA cache)."""
        return None if self.hola is None else self.hola.meta()

    @classmethod
    def unflatten(cls, tensors: list[torch.Tensor], meta: dict | None) -> RecurrentLayerCache:
        own = len(cls.TENSORS)
        hola = None if meta is None else HolaCache.unflatten(list(tensors[own:]), meta)
        return cls(**dict(zip(cls.TENSORS, tensors[:own])), hola=hola)

    def map_tensors(self, fn) -> RecurrentLayerCache:
        """The same cache with every tensor ``fn(tensor)`` (select rows, clone, detach)."""
        return self.unflatten([fn(t) for t in self.flatten()], self.meta())

    @classmethod
    def stack_rows(cls, layers: list[RecurrentLayerCache], *, slots: int,
                   pad_slots: torch.Tensor) -> RecurrentLayerCache:
        """One batch from one-row caches: every row continues exactly where its own prompt stopped (the state is
        the state, whatever the padding), so the rows are concatenated."""
        return cls.unflatten([torch.cat(parts) for parts in zip(*(x.flatten() for x in layers))], layers[0].meta())


@dataclass
class AttentionLayerCache:
    """Decoding state of one Transformer++ layer: keys and values ``[B, t, H, D]`` so far (grows with t); ``pad``
    ``[B, t]`` marks the slots that left padding filled (None: none), which no query reads."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pad: torch.Tensor | None = None

    def flatten(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.pad) if t is not None]

    def map_tensors(self, fn) -> AttentionLayerCache:
        """The same cache with every tensor ``fn(tensor)`` (select rows, clone)."""
        return AttentionLayerCache(**{name: None if t is None else fn(t)
                                      for name, t in (("k", self.k), ("v", self.v), ("pad", self.pad))})

    @classmethod
    def stack_rows(cls, layers: list[AttentionLayerCache], *, slots: int,
                   pad_slots: torch.Tensor) -> AttentionLayerCache:
        """One batch from one-row caches: keys and values left-padded to ``slots``, the pad slots masked."""
        def left_pad(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, 0, slots - t.shape[1], 0))
        pad = torch.arange(slots, device=pad_slots.device)[None, :] < pad_slots[:, None]
        return cls(k=torch.cat([left_pad(x.k) for x in layers]), v=torch.cat([left_pad(x.v) for x in layers]),
                   pad=pad)


@dataclass
class ModelCache:
    """Per-layer decoding state plus the number of token slots seen. Updated in place by ``HolaTitanLM.forward``.

    After a left-padded prefill (:meth:`HolaTitanLM.prefill`) ``seen`` counts the padded slots, as a caller that
    padded the batch counts them, and ``pad_slots`` ``[B]`` how many of them were padding in each row."""

    layers: dict[str, RecurrentLayerCache | AttentionLayerCache] = field(default_factory=dict)
    seen: int = 0
    pad_slots: torch.Tensor | None = None

    @classmethod
    def stack_rows(cls, rows: list[ModelCache], *, slots: int) -> ModelCache:
        """One batch cache from the one-row caches of prompts that a batch left-pads to ``slots`` tokens: every
        row continues exactly where its own prompt stopped (the recurrent state, tails and HOLA cache of each
        row are that row's; Transformer++ keys and values are left-padded, and the pad slots masked)."""
        if not rows or any(r.pad_slots is not None or r.seen > slots for r in rows):
            raise ValueError("cache: stack_rows takes unpadded one-row caches of at most `slots` tokens")
        device = next(iter(rows[0].layers.values())).flatten()[0].device
        out = cls(seen=slots, pad_slots=torch.tensor([slots - r.seen for r in rows], dtype=torch.int64,
                                                     device=device))
        for name, first in rows[0].layers.items():
            out.layers[name] = type(first).stack_rows([r.layers[name] for r in rows], slots=slots,
                                                      pad_slots=out.pad_slots)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.flatten())


class GatedDeltaMixer(LocalParams, nn.Module):
    """The HOLA token mixer (``evict`` score or recency) or plain Gated DeltaNet (``evict`` none).

    Two things let ``hola_titan.parallelisms`` distribute the layer without this file touching
    ``torch.distributed``: parameters are read through ``param`` (:class:`LocalParams`: under tensor
    parallelism, the local shard of a head-sharded parameter, as the plan records), and the batch context's
    ``cp`` (context parallel), whose ``layer(...)`` gives this call's handover: ``conv_tails(xs, positions)``
    returns the previous shard's convolution inputs, ``attention`` replaces ``hola_attention`` with the shard's
    continuation of the previous rank's state and cache (same signature).
    """

    Cache = RecurrentLayerCache
    CACHE_PARAMETERS = ("gamma_q", "gamma_k", "sink", "gate")  # the HOLA cache's own, absent with evict "none"
    # Tensor parallelism (applied by hola_titan.parallelisms.tensor_parallel): projections split by heads, the
    # output projection row-wise, and per submodule ("" is the mixer itself) the per-head parameters sharded with
    # their heads or, per channel, replicated.
    TP_COLWISE = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")
    TP_ROWWISE = ("o_proj",)
    TP_PER_HEAD = {"q_conv": {"weight": "shard"}, "k_conv": {"weight": "shard"}, "v_conv": {"weight": "shard"},
                   "o_norm": {"weight": "replicate"},
                   "": {"A_log": "shard", "dt_bias": "shard", "sink": "shard", "gate": "shard",
                        "gamma_q": "replicate", "gamma_k": "replicate"}}

    def __init__(self, args: ModelArgs, *, backend: str = "auto", kernels: str = "reference",
                 overlap_backward: bool = False, save_cache_output: bool = False):
        super().__init__()
        dim, h, d = args.dim, args.n_heads, args.head_dim
        self.num_heads, self.head_dim = h, d
        # What every call of the op takes, made (and checked) once; context parallelism gets it whole.
        self.settings = HolaSettings(window=args.window, block=args.block, evict=args.evict, backend=backend,
                                     overlap_backward=overlap_backward, scale=args.state_scale,
                                     mix="sum" if args.cache_mix == "before_norm" else "parts",
                                     save_cache_output=save_cache_output)  # refused for evict "none" (GDN)
        if kernels not in ("triton", "reference"):
            raise ValueError(f"kernels: expected 'triton' or 'reference' (resolved), got {kernels!r}")
        self.kernels = kernels
        self.q_proj = nn.Linear(dim, h * d, bias=False)
        self.k_proj = nn.Linear(dim, h * d, bias=False)
        self.v_proj = nn.Linear(dim, h * d, bias=False)
        self.q_conv = ShortConvolution(h * d, args.conv_size)
        self.k_conv = ShortConvolution(h * d, args.conv_size)
        self.v_conv = ShortConvolution(h * d, args.conv_size)
        self.a_proj = nn.Linear(dim, h, bias=False)
        self.b_proj = nn.Linear(dim, h, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(h))
        if self.settings.evict != "none":
            self.gamma_q = nn.Parameter(torch.empty(d))
            self.gamma_k = nn.Parameter(torch.empty(d))
            self.sink = nn.Parameter(torch.empty(h))
            self.gate = nn.Parameter(torch.empty(h))
        self.g_proj = nn.Linear(dim, h * d, bias=False) if args.use_gate else None
        self.o_norm = RMSNorm(d, args.norm_eps)
        self.o_proj = nn.Linear(h * d, dim, bias=False)
        self.gate_init, self.cache_mix, self.cache_sink = args.gate_init, args.cache_mix, args.cache_sink

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=out_std)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.init_weights()
        self.o_norm.init_weights()
        with torch.no_grad():
            # Mamba-2 / GDN: A ~ U(1, 16), dt = exp(U(log 1e-3, log 1e-1)), dt_bias = softplus^-1(dt).
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if self.settings.evict != "none":
                self.gamma_q.fill_(1.0)
                self.gamma_k.fill_(1.0)
                self.sink.fill_(0.0)
                self.gate.fill_(self.gate_init)

    @staticmethod
    def stream(args: ModelArgs, tokens: torch.Tensor, context: BatchContext,
               cache: ModelCache | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tokens, positions)`` as this mixer's blocks take a batch: packed rows become one stream of documents
        ``[1, B*T]`` (the recurrent op takes B = 1 with ``cu_seqlens``; flattening the token ids, not the
        activations, keeps sequence-sharded activations 3-D) with in-document positions; plain rows stay, with
        no positions. What every layer derives from the documents alone (the HOLA block table) is made here,
        once, outside the compiled blocks."""
        documents = context.documents
        if documents is None:
            return tokens, None
        bsz, seq_len = tokens.shape
        positions = document_positions(bsz, seq_len, documents.cu_seqlens, tokens.device).reshape(1, -1)
        if args.evict != "none":
            documents.block_table(args.block)
        return tokens.reshape(1, -1), positions

    def forward(self, x: torch.Tensor, *, context: BatchContext, positions: torch.Tensor | None,
                cache: RecurrentLayerCache | None) -> torch.Tensor:
        """x ``[B, T, dim]`` (B = 1 with packed documents); ``positions`` in-document positions ``[B, T]``
        (:meth:`stream`). With ``cache``, continues from it (decoding, chunked prefill) and updates it in place."""
        cp = None
        if context.cp is not None:  # keyed by this mixer: a re-run under activation checkpointing reads its messages
            if cache is not None:
                raise ValueError("cache: decoding does not run under context parallelism")
            cp = context.cp.layer(self, head_dim=self.head_dim, settings=self.settings)
        continuing = cache is not None and cache.state is not None
        q, k, v, tails = self._convolve(x, positions=positions, cp=cp, cache=cache, continuing=continuing)
        o = self._attend(x, q, k, v, documents=context.documents, cp=cp, cache=cache, continuing=continuing)
        if cache is not None:
            cache.conv_q, cache.conv_k, cache.conv_v = tails
        o = self._mix(o)
        bsz, seq_len, _ = x.shape
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x).view(bsz, seq_len, -1, self.head_dim))
        return self.o_proj(o.reshape(bsz, seq_len, -1))

    def _mix(self, o: torch.Tensor) -> torch.Tensor:
        """The output norm and the mixing point (``ModelArgs.cache_mix``): ``o`` is the op's sum, or its parts
        ``[..., :D]`` o_state and ``[..., D:]`` sigmoid(gate) o_cache (``mix="parts"``)."""
        if self.settings.mix == "sum":
            return self.o_norm(o)
        o_state, gated = o.split(self.head_dim, dim=-1)
        if self.cache_mix == "after_norm":
            return self.o_norm(o_state) + gated
        # per_path_norm: the norm of the read itself, then the gate (a norm after the gate would cancel it). The op
        # hands the read gated: dividing by the same lambda gives the read back, and the gate's gradient is
        # lambda' o_norm(o_cache) as the formula says.
        cdt = torch.promote_types(gated.dtype, torch.float32)
        lam = torch.sigmoid(self.param("gate").to(cdt)).view(1, 1, -1, 1)
        return self.o_norm(o_state) + (lam * self.o_norm((gated.to(cdt) / lam).to(gated.dtype))).to(gated.dtype)

    def _convolve(self, x, *, positions, cp, cache, continuing: bool):
        """``(q, k, v [B, T, H*D], tails)``: the projections through the short convolutions, and the tails they
        leave. One path whatever supplies the tails the convolutions start from: the previous shard (context
        parallelism, which also says which tokens continue a document of an earlier rank), a decoding cache being
        continued, or nothing (every row or document starts here). The fused kernel serves the last case where it
        applies (:meth:`_fused_conv_applies`)."""
        if self._fused_conv_applies(cp, cache):
            # One q|k|v projection and one convolution kernel each way (hola_titan/kernels/fused/short_conv.py).
            from hola_titan.kernels.fused.short_conv import short_conv_qkv
            w_qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            q, k, v = short_conv_qkv(F.linear(x, w_qkv), [self.q_conv.weight, self.k_conv.weight,
                                                           self.v_conv.weight], positions=positions)
            return q, k, v, None
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        continues = None
        if cp is not None:
            tails, continues = cp.conv_tails(projected, positions)
        elif continuing:
            tails, positions = (cache.conv_q, cache.conv_k, cache.conv_v), None
        else:
            tails = (None, None, None)
        (q, tail_q), (k, tail_k), (v, tail_v) = (
            conv(p, positions=positions, tail=t, continues=continues)
            for conv, p, t in zip((self.q_conv, self.k_conv, self.v_conv), projected, tails))
        return q, k, v, (tail_q, tail_k, tail_v)

    def _fused_conv_applies(self, cp, cache) -> bool:
        """The fused convolution serves a call that starts every row or document here (no context parallelism, no
        decoding cache) with plain projections and convolutions (not tensor-parallel, not converted) on the
        Triton kernels; the PyTorch path serves the rest."""
        if self.kernels != "triton" or cp is not None or cache is not None:
            return False
        if self.computes_locally or any(c.computes_locally for c in (self.q_conv, self.k_conv, self.v_conv)):
            return False  # tensor parallelism computes with local shards
        from hola_titan.kernels.fused.short_conv import supports
        return (all(_is_plain_linear(p) for p in (self.q_proj, self.k_proj, self.v_proj))
                and supports(self.q_proj.out_features, self.q_proj.weight.device))

    def _attend(self, x, q, k, v, *, documents, cp, cache, continuing: bool) -> torch.Tensor:
        """The gates and the op over the convolved ``q, k, v [B, T, H*D]``: ``o [B, T, H, D]`` before the output
        norm; a decoding ``cache`` gets the final state and HOLA cache."""
        bsz, seq_len, _ = x.shape
        # -1: under tensor parallelism only the local heads are here.
        q, k, v = (t.view(bsz, seq_len, -1, self.head_dim) for t in (q, k, v))
        gate_dtype = torch.promote_types(x.dtype, torch.float32)  # gates in at least float32
        beta = torch.sigmoid(self.b_proj(x).to(gate_dtype))
        g = -self.param("A_log").to(gate_dtype).exp() * F.softplus(self.a_proj(x).to(gate_dtype)
                                                                      + self.param("dt_bias").to(gate_dtype))
        cache_params = (None, None, None, None)
        if self.settings.evict != "none":
            cache_params = tuple(self.param(name) for name in self.CACHE_PARAMETERS)
            if not self.cache_sink:
                # No sink (model.cache_sink false): a logit no score reaches, exp() of it 0 in every dtype's softmax;
                # a constant, so the unused parameter gets no gradient.
                gamma_q, gamma_k, sink, gate = cache_params
                cache_params = (gamma_q, gamma_k, torch.full(sink.shape, NO_SINK, dtype=sink.dtype,
                                                             device=sink.device), gate)
        if cp is not None:
            return cp.attention(q, k, v, g, beta, *cache_params, documents=documents)[0]
        want_cache = cache is not None and self.settings.evict != "none"
        result = hola_attention(
            q, k, v, g, beta, *cache_params, **self.settings.kwargs(), documents=documents,
            initial_state=cache.state if continuing else None, output_final_state=cache is not None,
            initial_cache=cache.hola if want_cache and continuing else None, output_final_cache=want_cache)
        if cache is not None:
            cache.state, cache.hola = result[1], result[2] if want_cache else None
        return result[0]


class Attention(nn.Module):
    """Transformer++ attention: RoPE, SDPA, causal within each document. Built and called as every mixer is
    (``hola_titan.models.flavours``); ``backend``, ``kernels`` and ``overlap_backward`` choose paths of the
    recurrent mixers and change nothing here (SDPA runs); ``save_cache_output``, which would keep memory for a
    HOLA cache read, is refused."""

    Cache = AttentionLayerCache
    TP_COLWISE = ("q_proj", "k_proj", "v_proj")
    TP_ROWWISE = ("o_proj",)
    TP_PER_HEAD: dict = {}

    def __init__(self, args: ModelArgs, *, backend: str = "auto", kernels: str = "reference",
                 overlap_backward: bool = False, save_cache_output: bool = False):
        super().__init__()
        if save_cache_output:
            raise ValueError("save_cache_output: the transformer flavour has no HOLA cache read to keep")
        h, d = args.n_heads, args.head_dim
        self.num_heads, self.head_dim, self.rope_theta = h, d, args.rope_theta
        self.q_proj = nn.Linear(args.dim, h * d, bias=False)
        self.k_proj = nn.Linear(args.dim, h * d, bias=False)
        self.v_proj = nn.Linear(args.dim, h * d, bias=False)
        self.o_proj = nn.Linear(h * d, args.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=out_std)

    @staticmethod
    def stream(args: ModelArgs, tokens: torch.Tensor, context: BatchContext,
               cache: ModelCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, positions)``: rows stay rows; RoPE positions restart at each document start and continue a
        decoding cache (counting each row's own tokens after left padding). The documents' ids per token, which
        every layer's mask reads, are made here once."""
        documents = context.documents
        bsz, seq_len = tokens.shape
        cu_seqlens = documents.cu_seqlens if documents is not None else None
        positions = document_positions(bsz, seq_len, cu_seqlens, tokens.device)
        if documents is not None:
            _doc_ids(documents, bsz, seq_len)
        if cache is not None:
            positions = positions + cache.seen
            if cache.pad_slots is not None:
                positions = positions - cache.pad_slots[:, None]
        return tokens, positions

    def forward(self, x: torch.Tensor, *, context: BatchContext, positions: torch.Tensor,
                cache: AttentionLayerCache | None) -> torch.Tensor:
        """x ``[B, T, dim]``; ``positions`` ``[B, T]`` (:meth:`stream`). The context's documents make the mask
        document-causal (None: each row is one document); its ``cp`` is the context-parallel view (this rank holds
        one shard of every row): RoPE at global positions, and exact causal attention over every rank's keys and
        values (``cp.causal_attention``)."""
        bsz, seq_len, _ = x.shape
        cp = context.cp
        doc_ids = _doc_ids(context.documents, bsz, seq_len) if context.documents is not None else None
        if cp is not None:
            if cache is not None:
                raise ValueError("cache: decoding does not run under context parallelism")
            if doc_ids is not None:
                raise ValueError("data.varlen: must be false for transformer with context_parallel_degree > 1")
            positions = positions + cp.shard_start
        d = self.head_dim  # heads as -1: under tensor parallelism only the local heads are here
        q = apply_rope(self.q_proj(x).view(bsz, seq_len, -1, d), positions, self.rope_theta)
        k = apply_rope(self.k_proj(x).view(bsz, seq_len, -1, d), positions, self.rope_theta)
        v = self.v_proj(x).view(bsz, seq_len, -1, d)
        pad = None
        if cache is not None:
            if cache.k is not None:
                k = torch.cat([cache.k, k], dim=1)
                v = torch.cat([cache.v, v], dim=1)
            if cache.pad is not None:  # slots of left padding: no query reads them
                cache.pad = pad = F.pad(cache.pad, (0, seq_len), value=False)
            cache.k, cache.v = k, v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        past = k.shape[2] - seq_len
        if cp is not None:
            o = cp.causal_attention(q, k, v)
        elif doc_ids is None and past == 0 and pad is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            qi = torch.arange(seq_len, device=x.device)[:, None] + past
            kj = torch.arange(k.shape[2], device=x.device)[None, :]
            mask = (kj <= qi)[None]
            if doc_ids is not None:
                mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])
            if pad is not None:
                mask = mask & ~pad[:, None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(bsz, seq_len, -1))


def _doc_ids(documents: Documents, bsz: int, seq_len: int) -> torch.Tensor:
    """Every token's document index ``[B, T]``, made once per batch and kept with its documents."""
    return documents.derived(("doc_ids", bsz, seq_len),
                             lambda: document_ids(bsz, seq_len, documents.cu_seqlens, documents.cu_seqlens.device))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, args: ModelArgs, *, backend: str, kernels: str, overlap_backward: bool = False,
                 save_cache_output: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = args.mixer_class()(args, backend=backend, kernels=kernels, overlap_backward=overlap_backward,
                                       save_cache_output=save_cache_output)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.mlp_hidden)

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attn.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)

    def forward(self, x: torch.Tensor, **mixer_kwargs) -> torch.Tensor:
        x = x + self.attn(self.attention_norm(x), **mixer_kwargs)
        return x + self.feed_forward(self.ffn_norm(x))


class HolaTitanLM(nn.Module):
    """Decoder-only language model of any flavour (see the module docstring)."""

    def __init__(self, args: ModelArgs, *, backend: str = "auto", kernels: str = "reference",
                 overlap_backward: bool = False, save_cache_output: bool = False):
        super().__init__()
        self.args = args
        self.kernels = kernels
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, backend=backend, kernels=kernels,
                                                              overlap_backward=overlap_backward,
                                                              save_cache_output=save_cache_output)
                                     for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied embeddings reuse ``tok_embeddings.weight`` in ``forward``: one parameter, so that ``to_empty``
        # and sharding cannot untie it.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_parts(self):
        """``(fully qualified prefix, module, init)`` in the order :meth:`init_weights` draws them from the global
        RNG: the embedding, each block, the final norm, an untied head. ``init(module)`` initialises that module's
        parameters; :func:`hola_titan.parallelisms.init.init_like_one_process` replays the same sequence part by
        part for a sharded model."""
        out_std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        yield "tok_embeddings", self.tok_embeddings, lambda m: nn.init.normal_(m.weight, std=INIT_STD)
        for name, block in self.layers.items():
            yield f"layers.{name}", block, lambda m: m.init_weights(INIT_STD, out_std)
        yield "norm", self.norm, lambda m: m.init_weights()
        if self.output is not None:
            yield "output", self.output, lambda m: nn.init.normal_(m.weight, std=INIT_STD)

    def init_weights(self) -> None:
        """Draw every parameter from the global RNG (call after ``to_empty``); then check all are finite."""
        with torch.no_grad():
            for _, module, init in self.init_parts():
                init(module)
        self.check_finite()

    def check_finite(self) -> None:
        """Raise ``ValueError`` naming the first parameter that holds NaN or inf."""
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            if not torch.isfinite(local).all():
                raise ValueError(f"parameter {name} holds NaN or inf after initialisation")

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @staticmethod
    def _context(tokens: torch.Tensor, cu_seqlens: torch.Tensor | None, context: BatchContext | None) -> BatchContext:
        """The batch's context: the one given, or one made here from bare ``cu_seqlens`` (read once, then shared
        by every layer)."""
        if cu_seqlens is None:
            if context is not None and not isinstance(context, BatchContext):
                raise ValueError(f"context: expected a BatchContext, got {type(context).__name__}")
            return context if context is not None else NO_CONTEXT
        if context is not None:
            raise ValueError("cu_seqlens: give cu_seqlens or context, not both")
        return BatchContext(documents=Documents.of(cu_seqlens, seq_len=tokens.numel(), device=tokens.device))

    def _trunk(self, tokens: torch.Tensor, context: BatchContext, cache: ModelCache | None,
               flat: bool = False) -> torch.Tensor:
        """Final-norm hidden states; ``[1, B*T, dim]`` for packed recurrent rows, else ``[B, T, dim]``; with
        ``flat``, ``[B*T, dim]`` made by the norm itself (not a view of its output)."""
        bsz, seq_len = tokens.shape
        documents = context.documents
        cu_seqlens = documents.cu_seqlens if documents is not None else None
        if documents is not None and documents.seq_len != tokens.numel():
            raise ValueError(f"cu_seqlens: made for {documents.seq_len} tokens, the batch has {tokens.numel()}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cu_seqlens: decoding with a cache takes unpacked rows")
        mixer = self.args.mixer_class()
        tokens, positions = mixer.stream(self.args, tokens, context, cache)
        h = self.tok_embeddings(tokens)
        for name, block in self.layers.items():
            layer_cache = cache.layers.setdefault(name, mixer.Cache()) if cache is not None else None
            h = block(h, context=context, positions=positions, cache=layer_cache)
        if cache is not None:
            cache.seen += seq_len
        return self.norm(h.reshape(-1, h.shape[-1]) if flat else h)

    def hidden_states(self, tokens: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                      context: BatchContext | None = None, cache: ModelCache | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, dim]`` for token ids ``[B, T]`` (arguments as :meth:`forward`)."""
        return self._trunk(tokens, self._context(tokens, cu_seqlens, context), cache).reshape(*tokens.shape, -1)

    def flat_hidden_states(self, tokens: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                           context: BatchContext | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B*T, dim]`` for token ids ``[B, T]``, as the training loss takes them. Not a
        view: FSDP registers its backward hooks on a forward method's output, and warns that in-place ops on a
        view could bypass them."""
        return self._trunk(tokens, self._context(tokens, cu_seqlens, context), None, flat=True)

    def forward(self, tokens: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                context: BatchContext | None = None, cache: ModelCache | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]``. Packed documents: ``cu_seqlens`` (``[N + 1]`` over the flattened ``B * T``
        tokens, read once) or a :class:`~hola_titan.models.context.BatchContext` made once per batch (its
        documents carry their host copy, so no layer reads the device; it also carries a context-parallel
        shard's view). With ``cache``, continues from it and updates it in place (decoding)."""
        logits = F.linear(self._trunk(tokens, self._context(tokens, cu_seqlens, context), cache),
                          self.output_weight())
        return logits.reshape(*tokens.shape, -1)

    def prefill(self, tokens: torch.Tensor, *, lengths: list[int], cache: ModelCache) -> torch.Tensor:
        """Logits ``[B, T, V]`` of left-padded prompts: row ``b``'s prompt is its last ``lengths[b]`` tokens,
        the slots before it are padding. Fills the empty ``cache`` so that decoding continues every row exactly as
        if its prompt had run alone: padding changes no state, convolution tail, score or cache entry (each row
        is run alone, then the rows' caches are stacked: :meth:`ModelCache.stack_rows`). The logits of pad slots
        are zero."""
        bsz, slots = tokens.shape
        if cache.seen or cache.layers:
            raise ValueError("cache: a padded prefill starts from an empty cache")
        if len(lengths) != bsz or any(not 1 <= n <= slots for n in lengths):
            raise ValueError(f"attention_mask: every row needs 1 to {slots} tokens, got lengths {lengths}")
        logits = None
        rows = []
        for b, n in enumerate(lengths):
            row = ModelCache()
            out = self(tokens[b:b + 1, slots - n:], cache=row)
            if logits is None:
                logits = out.new_zeros(bsz, slots, out.shape[-1])
            logits[b, slots - n:] = out[0]
            rows.append(row)
        stacked = ModelCache.stack_rows(rows, slots=slots)
        cache.layers, cache.seen, cache.pad_slots = stacked.layers, stacked.seen, stacked.pad_slots
        return logits

    def no_weight_decay_names(self) -> set[str]:
        """Parameters excluded from weight decay: the GDN decay parameters (as fla does)."""
        return {name for name, _ in self.named_parameters() if name.endswith(("A_log", "dt_bias"))}

    def cache_parameter_names(self) -> set[str]:
        """The HOLA cache's own parameters (``gamma_q``, ``gamma_k``, ``sink``, ``gate`` of every layer), which the
        optimizer settings ``decay_cache_scalars`` and ``cache_lr_multiplier`` address."""
        return {f"{prefix}.{name}" for prefix, module in self.named_modules()
                if isinstance(module, GatedDeltaMixer) and module.settings.evict != "none"
                for name in GatedDeltaMixer.CACHE_PARAMETERS}


def build_model(args: ModelArgs, *, device: torch.device | str = "meta", backend: str = "auto",
                kernels: str = "reference") -> HolaTitanLM:
    """``HolaTitanLM`` on ``device``; on a real device the weights are also initialised.

    Always built on the meta device first (``nn.Linear`` and ``nn.Embedding`` would otherwise draw their own
    default init from the global RNG in ``__init__``), then materialised with ``to_empty`` and initialised by
    ``init_weights``: the weights depend only on the RNG state and the arguments, so they equal the trainer's at
    every parallel layout (``hola_titan.parallelisms.init``)."""
    with torch.device("meta"):
        model = HolaTitanLM(args, backend=backend, kernels=kernels)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def num_params(model: nn.Module) -> int:
    """Number of parameters (shared parameters counted once; works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
