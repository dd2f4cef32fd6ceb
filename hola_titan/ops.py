"""``hola_attention``: the functional core of the HOLA layer (DESIGN §2).

Shape legend: B batch, T tokens, H heads, D head dim, N sequences (B, or documents with ``cu_seqlens``).

Math (per sequence and head; ``qh, kh`` are l2-normalised q, k; ``s`` the state read's ``scale``, ``D^-1/2`` unless
given, as in fla):
    e_t = v_t - alpha_t S_{t-1}^T kh_t,   S_t = alpha_t S_{t-1} + beta_t kh_t e_t^T,   o_state_t = s S_t^T qh_t
    m_t = beta_t ||e_t||  (detached)
    o_cache_t = softmax over [P_b | causal tokens of block b | sink] of  qc_t . kc_j / sqrt(D)  times v_j
    o_t = o_state_t + sigmoid(gate_h) o_cache_t
with ``alpha = exp(g)``, ``qc = RMSNorm_{gamma_q}(q)``, ``kc = RMSNorm_{gamma_k}(k)``, blocks of ``block``
tokens aligned to each document start, and ``P_b`` the ``window`` earlier positions of the document with the
largest m (``evict="score"``) or the ``window`` positions just before the block (``evict="recency"``).
``evict="none"`` is plain Gated DeltaNet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hola_titan.kernels.hola import decode
from hola_titan.kernels.dispatch import call_path, explain_backend, resolve_backend, resolve_kernels
from hola_titan.kernels.runtime.documents import Documents
from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.reference import hola_attention_reference

if TYPE_CHECKING:  # the Triton backend's module, imported where it runs
    from hola_titan.kernels.hola.continuation import ContinuationLayout

EVICT_MODES = ("score", "recency", "none")
# What ``o`` holds: the sum o_state + sigmoid(gate) o_cache, or both parts side by side in the last dimension
# ``[..., :D]`` o_state and ``[..., D:]`` sigmoid(gate) o_cache, for a layer that mixes them after its output norm.
MIXES = ("sum", "parts")
BACKENDS = ("auto", "reference", "sdpa", "triton", "fa4")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class HolaSettings:
    """What one HOLA (or GDN) layer passes to :func:`hola_attention` on every call: its cache's ``window`` and
    ``block``, the eviction, the backend, the overlapped backward, whether the Triton backend keeps the cache
    read's output for its backward (``save_cache_output``), the state read's ``scale`` and the ``mix``. Made once by
    the layer,
    checked then, and handed whole to the op (:meth:`kwargs`) and to context parallelism, so that no caller repeats
    the keywords."""

    window: int
    block: int
    evict: str
    backend: str = "auto"
    overlap_backward: bool = False
    save_cache_output: bool = False
    scale: float | None = None
    mix: str = "sum"

    def __post_init__(self):
        check_scale(self.scale)
        if self.mix not in MIXES:
            raise ValueError(f"mix: expected one of {MIXES}, got {self.mix!r}")
        if self.mix != "sum" and self.evict == "none":
            raise ValueError("mix: evict 'none' (GDN) has no cache read to keep apart")
        if self.window < 0:
            raise ValueError(f"window: must be >= 0, got {self.window}")
        if self.block <= 0:
            raise ValueError(f"block: must be >= 1, got {self.block}")
        if self.evict not in EVICT_MODES:
            raise ValueError(f"evict: expected one of {EVICT_MODES}, got {self.evict!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.save_cache_output and self.overlap_backward:
            raise ValueError("save_cache_output: not available with overlap_backward (the overlapped layer op "
                             "forms delta over the keys); choose one")
        if self.save_cache_output and self.evict == "none":
            raise ValueError("save_cache_output: evict 'none' (GDN) has no cache read to keep")

    def kwargs(self) -> dict:
        """The keyword arguments of :func:`hola_attention` these settings give."""
        return dict(window=self.window, block=self.block, evict=self.evict, backend=self.backend,
                    overlap_backward=self.overlap_backward, save_cache_output=self.save_cache_output,
                    scale=self.scale, mix=self.mix)


def check_scale(scale) -> None:
    """``ValueError`` naming ``scale`` unless it is None or a finite positive number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: must be a finite number > 0 or None (D^-1/2), got {scale!r}")


def hola_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   gamma_q: torch.Tensor | None, gamma_k: torch.Tensor | None, sink: torch.Tensor | None,
                   gate: torch.Tensor | None, *, window: int = 64, block: int = 256, evict: str = "score",
                   cu_seqlens: torch.Tensor | None = None, documents: Documents | None = None,
                   initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                   initial_cache: HolaCache | None = None, output_final_cache: bool = False,
                   backend: str = "auto", overlap_backward: bool = False, save_cache_output: bool = False,
                   continuation: ContinuationLayout | None = None, scale: float | None = None, mix: str = "sum"):
    """HOLA attention over ``[B, T, H, D]`` inputs.

    Args:
        q, k, v: ``[B, T, H, D]`` after the short convolution, before any norm.
        g: ``[B, T, H]`` log-decay (``alpha = exp(g)``). beta: ``[B, T, H]`` write strength in (0, 1).
        gamma_q, gamma_k: ``[D]`` RMSNorm weights of the cache path. sink, gate: ``[H]`` sink logit and gate
            (``lambda = sigmoid(gate)``). All four may be ``None`` when ``evict == "none"``.
        window: persistent cache size W >= 0. block: block length C >= 1.
        evict: ``"score"`` (HOLA), ``"recency"`` (HOLA+recency) or ``"none"`` (GDN).
        cu_seqlens: ``[N + 1]`` int32/int64 document boundaries of a packed row (only with B == 1); its values
            are read on the host once per call (a synchronisation on CUDA).
        documents: the same boundaries as a :class:`~hola_titan.kernels.runtime.documents.Documents`, checked once per
            batch with their host copy: what a model passes to every layer, so that no layer reads the device.
            Give ``cu_seqlens`` or ``documents``, not both.
        initial_state: ``[N, H, D, D]`` state to start from (N = B without ``cu_seqlens``).
        output_final_state: return the final state ``[N, H, D, D]`` (float32, float64 for float64 inputs).
        initial_cache / output_final_cache: a :class:`HolaCache` to continue from / to return.
        backend: ``"auto"``, ``"reference"``, ``"sdpa"``, ``"triton"`` or ``"fa4"`` (the Triton backend's state
            path and selection, the cache read as one FlashAttention-4 varlen call on sm_90; never ``"auto"``'s
            choice). A decoding step (one token per row,
            no ``cu_seqlens``, continuing from a state and cache, no gradient wanted) runs the same arithmetic
            as the reference through ``hola_titan/kernels/hola/decode.py`` with every backend but ``"reference"``.
        overlap_backward: Triton backend on CUDA: the layer as one op whose backward overlaps the cache
            attention's backward (a side stream) with fla's (``hola_titan/kernels/hola/triton_layer.py``); same results.
        save_cache_output: Triton backend, a call without ``initial_cache``: keep the cache read's output
            (``[B, T, H, D]`` in the input dtype) for the backward, which then forms the softmax gradient's row
            sums from it instead of a pass over the keys (faster, one more token-sized tensor held until the
            backward). The reference and sdpa paths refuse it; decoding steps and calls continuing from a cache
            run without it (they keep nothing for a backward, or form delta over the cache's rows).
        continuation: with ``initial_cache``, the batch's
            :class:`~hola_titan.kernels.hola.continuation.ContinuationLayout` for these shapes and the cache's token
            counts, made once for all layers (the Triton backend's index work for continuing); None: made in the
            call. The other backends do not need one.
        scale: the state read's factor ``s`` in ``o_state = s S^T qh`` (a number > 0); None: ``D^-1/2``, fla's
            default. The paper's Eq. 1 and 3 read ``q^T S`` (``scale=1``). It changes only the state read: the
            state, the score and the cache read are the same.
        mix: ``"sum"``: ``o = o_state + sigmoid(gate) o_cache``; ``"parts"``: ``o`` is ``[B, T, H, 2 D]`` with
            ``o_state`` in ``[..., :D]`` and ``sigmoid(gate) o_cache`` in ``[..., D:]`` (a layer that mixes after its
            output norm); ``"parts"`` needs a cache (``evict`` score or recency).

    Returns:
        ``(o, final_state)``, or ``(o, final_state, final_cache)`` when ``output_final_cache`` is set;
        ``o`` is ``[B, T, H, D]`` (``[B, T, H, 2 D]`` with ``mix="parts"``) in the input dtype, before the output
        norm.
    """
    if continuation is not None and initial_cache is None:
        raise ValueError("continuation: a continuation layout needs the initial_cache it was made for")
    check_scale(scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if mix not in MIXES:
        raise ValueError(f"mix: unknown {mix!r}; expected one of {MIXES}")
    if mix != "sum" and evict == "none":
        raise ValueError("mix: 'parts' needs a cache read; evict is 'none' (GDN)")
    documents = _validate(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block, evict=evict,
                          cu_seqlens=cu_seqlens, documents=documents, initial_state=initial_state,
                          initial_cache=initial_cache, output_final_cache=output_final_cache, backend=backend)
    cu_seqlens = documents.cu_seqlens if documents is not None else None
    chosen = resolve_backend(backend, q.device)  # raises for a backend that cannot run here, decoding or not
    args = (q, k, v, g, beta, gamma_q, gamma_k, sink, gate)
    decoding = decode.applies(args, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                 initial_cache=initial_cache, evict=evict)
    path, _ = call_path(backend, chosen, q, decoding=decoding, initial_cache=initial_cache)
    if save_cache_output and path in ("reference", "sdpa", "fa4"):
        raise ValueError(f"save_cache_output: only the Triton backend keeps the cache read's output; this call "
                         f"takes the {path} path")
    if path == "decode_step":
        # Decoding: one token per row through a fixed, small set of tensor ops (hola_titan/kernels/hola/decode.py); the
        # blocked paths below cost about 1,500 ATen calls per layer for a single token.
        o, final_state, final_cache = decode.decode_step(
            *args, window=window, block=block, evict=evict, initial_state=initial_state,
            initial_cache=initial_cache, output_final_state=output_final_state,
            output_final_cache=output_final_cache, scale=scale, mix=mix)
        return (o, final_state, final_cache) if output_final_cache else (o, final_state)
    # fla's chunk indices and the block table, made once per batch with its Documents (None: made in the call).
    chunk_indices = documents.chunk_indices if documents is not None else None
    block_table = (documents.block_table(block) if documents is not None and path in ("triton", "sdpa", "fa4")
                   and evict != "none" and initial_cache is None else None)
    kw = dict(window=window, block=block, evict=evict, cu_seqlens=cu_seqlens, initial_state=initial_state,
              output_final_state=output_final_state, output_final_cache=output_final_cache, scale=scale, mix=mix)
    if path == "reference":
        o, final_state, final_cache = hola_attention_reference(*args, initial_cache=initial_cache, **kw)
    elif path == "triton":
        from hola_titan.kernels.hola.triton_backend import hola_attention_triton
        o, final_state, final_cache = hola_attention_triton(*args, initial_cache=initial_cache,
                                                            overlap_backward=overlap_backward,
                                                            save_cache_output=save_cache_output,
                                                            continuation=continuation,
                                                            chunk_indices=chunk_indices, block_table=block_table,
                                                            **kw)
    elif path == "fa4":
        from hola_titan.kernels.hola.fa4 import hola_attention_fa4
        o, final_state, final_cache = hola_attention_fa4(*args, chunk_indices=chunk_indices,
                                                         block_table=block_table, **kw)
    else:
        from hola_titan.kernels.hola.sdpa import hola_attention_sdpa
        o, final_state, final_cache = hola_attention_sdpa(*args, chunk_indices=chunk_indices,
                                                          block_table=block_table, **kw)
    if output_final_cache:
        return o, final_state, final_cache
    return o, final_state


def _validate(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, window, block, evict, cu_seqlens, documents,
              initial_state, initial_cache, output_final_cache, backend) -> Documents | None:
    """Raise ``ValueError`` naming the first bad argument; returns the call's :class:`Documents` (or None)."""
    if evict not in EVICT_MODES:
        raise ValueError(f"evict: unknown mode {evict!r}; expected one of {EVICT_MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: must be an integer >= 0, got {window!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block: must be an integer >= 1, got {block!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, D], got shape {list(q.shape)}")
    bsz, seq_len, h, d = q.shape
    if seq_len == 0:
        raise ValueError("q: sequence length must be >= 1")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q: unsupported dtype {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name}: shape {list(x.shape)} differs from q's {list(q.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from q's {q.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (bsz, seq_len, h):
            raise ValueError(f"{name}: expected shape {[bsz, seq_len, h]}, got {list(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: unsupported dtype {x.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != q.device:
            raise ValueError(f"{name}: on {x.device}, q on {q.device}")
    if evict != "none":
        for name, x, size in (("gamma_q", gamma_q, d), ("gamma_k", gamma_k, d), ("sink", sink, h), ("gate", gate, h)):
            if x is None:
                raise ValueError(f"{name}: required when evict is {evict!r}")
            if x.shape != (size,):
                raise ValueError(f"{name}: expected shape [{size}], got {list(x.shape)}")
    num_seqs = bsz
    if cu_seqlens is not None and documents is not None:
        raise ValueError("cu_seqlens: give cu_seqlens or documents, not both")
    if cu_seqlens is not None or documents is not None:
        if bsz != 1:
            raise ValueError(f"cu_seqlens: requires batch size 1, got B = {bsz}")
    if cu_seqlens is not None:
        documents = Documents.of(cu_seqlens, seq_len=seq_len, device=q.device)  # checks shape, dtype and values
    elif documents is not None:
        if not isinstance(documents, Documents):
            raise ValueError(f"documents: expected a Documents, got {type(documents).__name__}")
        if documents.seq_len != seq_len:
            raise ValueError(f"documents: made for T = {documents.seq_len} tokens, q has T = {seq_len}")
        if documents.cu_seqlens.device != q.device:
            raise ValueError(f"documents: on {documents.cu_seqlens.device}, q on {q.device}")
    if documents is not None:
        num_seqs = documents.num_docs
    if initial_state is not None:
        if initial_state.shape != (num_seqs, h, d, d):
            raise ValueError(f"initial_state: expected shape {[num_seqs, h, d, d]}, got {list(initial_state.shape)}")
    if evict == "none":
        if initial_cache is not None:
            raise ValueError("initial_cache: GDN (evict='none') has no cache")
    elif initial_cache is not None:
        if not isinstance(initial_cache, HolaCache):
            raise ValueError(f"initial_cache: expected a HolaCache, got {type(initial_cache).__name__}")
        initial_cache.check_matches(num_seqs=num_seqs, num_heads=h, head_dim=d, window=window, block=block,
                                    evict=evict)
    return documents


# The public interface: the op, its settings, and the decisions of hola_titan/kernels/dispatch.py that the trainer asks.
__all__ = ["hola_attention", "HolaSettings", "EVICT_MODES", "BACKENDS", "resolve_backend", "explain_backend",
           "resolve_kernels"]
