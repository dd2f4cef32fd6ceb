"""Context parallelism: every row is split into ``R`` contiguous shards, one per rank of the ``cp`` mesh.

Recurrent flavours (HOLA, HOLA+recency, GDN) pass each layer's recurrent state and cache along the ranks, point to
point, pipelined over the layers (DESIGN §3); Transformer++ runs exact causal attention over keys and values
all-gathered from the cp group.

Shape legend: R cp ranks, r this rank, T row length, L = T / R shard length, B rows, H heads (this rank's, under
tensor parallelism), D head dim, C block, W window, K conv kernel. "Chain" c: one row of the sharded stream,
followed across ranks. A local "sequence" is what ``hola_attention`` sees as one sequence: a row (unpacked) or a
segment of a document inside this rank's shard (packed). Positions are positions inside a document.

Layout (:class:`CPLayout`, built per batch from the global batch, identical on every rank of a cp group).
Packed batches (``cu_seqlens``) of recurrent flavours are first flattened into one stream of B*T tokens, as the
model itself flattens them, so rank r holds one contiguous piece of the global stream (one chain). Unpacked rows
keep their rows: rank r holds columns ``[rL, (r+1)L)`` of each (one chain per row). Per chain, the first local
sequence *continues* when its document began on an earlier rank, and the last one *crosses* when its document
goes on past the shard end; both sides of a boundary read that from the layout, so they agree on what crosses
without a message.

The protocol (one recurrent layer, :class:`CPLayer`). A document that crosses from rank r-1 into rank r continues
from exactly what ``hola_attention`` over its earlier tokens returns: its final recurrent state and its
``HolaCache`` (top-W entries with scores and positions, the unfinished block, tokens seen). So, per layer:
1. rank r receives one message from rank r-1: the last K-1 inputs of each short convolution of every row (the
   convolution tails), the final state of each crossing document and its cache;
2. it runs its shard as a continuation (``hola_attention`` with those initial states and caches; every block
   reads exactly what it reads in one process, and the scores are computed under the true incoming state);
3. it sends its own message (its tails, the final state and cache of the documents that cross out) to rank r+1.
Nothing is computed twice. A boundary that no document crosses (a packed shard that starts a document) carries
no message: that rank waits for nothing. Within one layer the ranks run one after another; across layers they
pipeline (rank r runs layer l while rank r-1 runs layer l+1), because a send does not wait for the receiver's
next layer: a forward of n layers takes about n + R - 1 shard-layer times (``hola_titan/parallelisms/critical_path.py``;
with FSDP over the cp ranks a rank runs at most one layer ahead of the next, docs/DESIGN.md §3).
Messages have a constant size per layer: ``3 B (K-1) H D`` tail inputs, ``n H D D`` state and ``n H (W + C)``
cache rows (keys, values, scores), all in the compute dtype, and the positions and ``seen`` in a second, integer
message; n the crossing documents (:func:`message_bytes`).

Backward runs the same chain in reverse: rank r receives the gradient of the message it sent from rank r+1
(``_Send``'s backward; a zero that the layer output carries brings backward there), the gradient flows through its
continuation, and the gradient of the message it received goes back to rank r-1 (``_Receive``'s backward). One
message per layer and direction, so the order of messages is the layer order on both sides of every boundary.

Activation checkpointing re-runs a layer's forward during backward: the layer's received messages are kept in the
:class:`CPBatch` under the mixer (``CPBatch.layer(key)``), and a re-run reads them and sends nothing.

FSDP composes: parameter collectives run at each layer in the same order on every rank, and every inter-rank
dependency points from a layer to the same or a later one, so nothing waits in a cycle.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.kernels.hola.reference import compute_dtype
from hola_titan.kernels.runtime.documents import Documents, to_device
from hola_titan.ops import HolaSettings, hola_attention


@dataclass(frozen=True)
class CPLayout:
    """Where the documents of one batch lie on the cp ranks (see the module docstring).

    Per rank ``j`` and chain ``c`` (``[R][num_rows]`` tuples): ``first_offset`` document tokens before the
    shard start (0: a document starts there), ``end_offset`` the document position at the shard end when the
    document crosses it (0: a document starts right after the shard, or j is the last rank), ``single``
    no document starts strictly inside the shard. Local sequences of this rank: ``seq_start``/``seq_len``
    over the flattened ``num_rows * shard_len`` local tokens and ``seq_offset`` (document tokens before).
    """

    cp_rank: int
    cp_size: int
    num_rows: int
    row_len: int
    packed: bool
    first_offset: tuple[tuple[int, ...], ...]
    end_offset: tuple[tuple[int, ...], ...]
    single: tuple[tuple[bool, ...], ...]
    seq_start: tuple[int, ...]
    seq_len: tuple[int, ...]
    seq_offset: tuple[int, ...]

    @property
    def shard_len(self) -> int:
        return self.row_len // self.cp_size

    @property
    def shard_start(self) -> int:
        """Column of the row where this rank's shard starts."""
        return self.cp_rank * self.shard_len

    @property
    def local_cu_seqlens(self) -> list[int]:
        return [*self.seq_start, self.num_rows * self.shard_len]

    def _chain_seqs(self, c: int) -> tuple[int, int]:
        """Index of the first and last local sequence of chain c."""
        if not self.packed:
            return c, c
        start, end = c * self.shard_len, (c + 1) * self.shard_len
        first = bisect.bisect_left(self.seq_start, start)
        return first, bisect.bisect_left(self.seq_start, end) - 1

    @property
    def in_seq(self) -> tuple[int, ...]:
        """Per chain: the local sequence that continues a document of an earlier rank, or -1."""
        r = self.cp_rank
        return tuple(self._chain_seqs(c)[0] if self.first_offset[r][c] > 0 else -1 for c in range(self.num_rows))

    @property
    def out_seq(self) -> tuple[int, ...]:
        """Per chain: the local sequence whose document crosses into the next rank, or -1."""
        r = self.cp_rank
        return tuple(self._chain_seqs(c)[1] if self.end_offset[r][c] > 0 else -1 for c in range(self.num_rows))


def build_layout(*, cp_rank: int, cp_size: int, num_rows: int, row_len: int,
                 cu_seqlens: list[int] | None) -> CPLayout:
    """The :class:`CPLayout` of ``num_rows`` rows of ``row_len`` tokens; ``cu_seqlens`` (over the flattened
    rows, every row starting a document) or None for one document per row."""
    if row_len % cp_size:
        raise ValueError(f"training.seq_len: a row of {row_len} tokens does not split into {cp_size} shards")
    shard = row_len // cp_size
    starts = [[0] for _ in range(num_rows)]
    if cu_seqlens is not None:
        cu = list(cu_seqlens)
        if cu[0] != 0 or cu[-1] != num_rows * row_len or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError("cu_seqlens: must increase strictly from 0 to the number of tokens")
        starts = [[s - c * row_len for s in cu[:-1] if c * row_len <= s < (c + 1) * row_len]
                  for c in range(num_rows)]
        if any(not row or row[0] != 0 for row in starts):
            raise ValueError("cu_seqlens: every row must start a document")

    def offset(c: int, p: int) -> int:
        return p - starts[c][bisect.bisect_right(starts[c], p) - 1]

    first, end, single = [], [], []
    for j in range(cp_size):
        lo, hi = j * shard, (j + 1) * shard
        first.append(tuple(offset(c, lo) for c in range(num_rows)))
        end.append(tuple(offset(c, hi) if j < cp_size - 1 else 0 for c in range(num_rows)))
        single.append(tuple(not any(lo < s < hi for s in starts[c]) for c in range(num_rows)))
    lo, hi = cp_rank * shard, (cp_rank + 1) * shard
    seq_start, seq_len, seq_offset = [], [], []
    for c in range(num_rows):
        bounds = [lo] + ([s for s in starts[c] if lo < s < hi] if cu_seqlens is not None else []) + [hi]
        for a, b in zip(bounds, bounds[1:]):
            seq_start.append(c * shard + a - lo)
            seq_len.append(b - a)
            seq_offset.append(offset(c, a))
    return CPLayout(cp_rank=cp_rank, cp_size=cp_size, num_rows=num_rows, row_len=row_len,
                    packed=cu_seqlens is not None, first_offset=tuple(first), end_offset=tuple(end),
                    single=tuple(single), seq_start=tuple(seq_start), seq_len=tuple(seq_len),
                    seq_offset=tuple(seq_offset))


def shard_batch(batch: dict, *, cp_rank: int, cp_size: int, recurrent: bool, conv_size: int) -> dict:
    """Rank ``cp_rank``'s shard of a batch that every rank of the cp group read whole, with its ``cp_layout``.

    Packed recurrent batches become one row of B*T tokens (then ``cu_seqlens`` holds this shard's sequences);
    unpacked rows keep their rows. Labels and position ids are sharded like the tokens. Raises ``ValueError``
    for a packed Transformer++ batch and for shards shorter than the convolution's tails.
    """
    tokens = batch["input_ids"]
    bsz, seq_len = tokens.shape
    cu = batch.get("cu_seqlens")
    if cu is not None and not recurrent:
        raise ValueError("data.varlen: must be false for transformer with context_parallel_degree > 1")
    rows, row_len = (1, bsz * seq_len) if cu is not None else (bsz, seq_len)
    layout = build_layout(cp_rank=cp_rank, cp_size=cp_size, num_rows=rows, row_len=row_len,
                          cu_seqlens=None if cu is None else cu.tolist())
    shard = layout.shard_len
    if recurrent and shard < conv_size - 1:
        # A shard may end inside a block (the next rank continues the unfinished block), but the convolution
        # tails come from the previous shard alone.
        raise ValueError(f"training.seq_len: the shard of {shard} tokens per cp rank must hold at least "
                         f"conv_size - 1 = {conv_size - 1} tokens")
    cols = slice(layout.shard_start, layout.shard_start + shard)
    local = {key: batch[key].reshape(rows, row_len)[:, cols] for key in ("input_ids", "labels", "position_ids")
             if key in batch}
    if cu is not None:
        local["cu_seqlens"] = torch.tensor(layout.local_cu_seqlens, dtype=cu.dtype, device=cu.device)
    local["cp_layout"] = layout
    return local


# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """``[R, *x.shape]``, x of every rank; backward reduce-scatters, so each rank gets the sum of the gradients
    that all ranks computed for its x (how borrowed rows send their gradients home)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_flat(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Flat buffers: gloo takes only the concatenated form.
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out.view(-1), grad.contiguous().view(-1), group=ctx.group)
        return out, None


def _gather_flat(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(dist.get_world_size(group), *x.shape)
    _all_gather_single(out.view(-1), x.detach().contiguous().view(-1), group=group)
    return out


class ContextParallel:
    """The context-parallel group of one model: the cp mesh and the flavour's constants, made once.

    Per batch, :meth:`shard_batch` cuts this rank's shard (with its :class:`CPLayout`) and :meth:`batch` makes
    the immutable per-batch view (:class:`CPBatch`) that the trainer passes through ``forward`` in the
    model's ``BatchContext``: nothing about a batch is stored here, so a forward re-run during backward
    (activation checkpointing) reads the context it is given. ``bytes_received`` counts the bytes this rank
    received in forward messages and all-gathers since it was last reset.
    """

    def __init__(self, cp_mesh: DeviceMesh, *, recurrent: bool, conv_size: int):
        # The mesh, not its ProcessGroup: a group object that outlives destroy_process_group into interpreter
        # shutdown makes gloo abort the process.
        self.mesh = cp_mesh
        self.cp_rank = cp_mesh.get_local_rank()
        self.cp_size = cp_mesh.size()
        self.recurrent = recurrent
        self.conv_size = conv_size
        self.bytes_received = 0

    # ------------------------------------------------------------------ batches

    def shard_batch(self, batch: dict) -> dict:
        """This rank's shard of ``batch`` (:func:`shard_batch`)."""
        return shard_batch(batch, cp_rank=self.cp_rank, cp_size=self.cp_size, recurrent=self.recurrent,
                           conv_size=self.conv_size)

    def batch(self, layout: CPLayout) -> CPBatch:
        """The per-batch view of ``layout`` (this rank's), for the model's ``BatchContext.cp``."""
        if (layout.cp_rank, layout.cp_size) != (self.cp_rank, self.cp_size):
            raise ValueError(f"cp_layout: built for rank {layout.cp_rank} of {layout.cp_size}, this is rank "
                             f"{self.cp_rank} of {self.cp_size}")
        return CPBatch(self, layout)

    # ------------------------------------------------------------------ collectives

    def _gather(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        """``[R, *x.shape]``: x of every cp rank. ``differentiable``: backward sums the gradients into x."""
        self.bytes_received += (self.cp_size - 1) * x.numel() * x.element_size()
        if differentiable and torch.is_grad_enabled() and x.requires_grad:
            return _AllGather.apply(x, self.mesh.get_group())
        return _gather_flat(x, self.mesh.get_group())


class CPBatch:
    """One batch's context-parallel view on this rank: its (immutable) layout, the index tensors every layer
    builds from it, made once (:meth:`memo`), and each layer's kept messages. The model calls :meth:`layer` (a
    recurrent mixer's handover) or :meth:`causal_attention` and :attr:`shard_start` (Transformer++)."""

    def __init__(self, group: ContextParallel, layout: CPLayout):
        self.group = group
        self.layout = layout
        self.cp_rank, self.cp_size = group.cp_rank, group.cp_size
        self._memo: dict = {}
        self._handover: dict = {}  # per layer key: what it received, and whether its forward ran (CPLayer)

    @property
    def shard_start(self) -> int:
        return self.layout.shard_start

    def memo(self, key, make):
        """``make()``, made once for this batch and kept under ``key``: the index tensors that every layer builds
        from the layout on the host. Made per layer, each one's copy to the GPU synchronised the host with the
        device (a copy from pageable memory waits for the stream), several times per layer."""
        if key not in self._memo:
            # Plain tensors even when first made under inference_mode (validation), so that a later forward of the
            # same batch that records gradients can save them.
            with torch.inference_mode(False):
                self._memo[key] = make()
        return self._memo[key]

    def _gather(self, x: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        return self.group._gather(x, differentiable=differentiable)

    @torch.compiler.disable
    def layer(self, key, *, head_dim: int, settings: HolaSettings) -> CPLayer:
        """One recurrent layer call (its convolution tails, then its attention) with the layer's ``settings``.
        ``key`` names the layer (the mixer module): a second call with the same key is its forward re-run under
        activation checkpointing."""
        return CPLayer(self, key, head_dim=head_dim, settings=settings)

    @torch.compiler.disable
    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Transformer++ under context parallelism: the local queries ``[B, H, L, D]`` attend to the keys and
        values of every rank, causal in global positions. Keys and values are all-gathered with autograd (O(T)
        bytes per layer; the simple exact alternative to ring attention, which PyTorch implements only for the
        CUDA SDPA kernels)."""
        kv = self._gather(torch.stack([k, v]), differentiable=True)  # [R, 2, B, H, L, D]
        keys, values = (torch.cat(kv[:, i].unbind(0), dim=2) for i in (0, 1))
        shard = q.shape[2]
        qi = torch.arange(shard, device=q.device)[:, None] + self.shard_start
        kj = torch.arange(keys.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=kj <= qi)


def _unrecorded():
    """Ops that op-level selective activation checkpointing must not see: it records every op of a block's first
    forward and requires its re-run to make the same ones, while the first run receives and sends and the re-run
    reads what was kept. (PyTorch's own torch.utils.checkpoint uses this context to step outside its modes.)"""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


class _Receive(torch.autograd.Function):
    """Forward: the message rank ``src`` sent, into a buffer like ``template`` (or, when a checkpointed forward
    runs again, ``replay``: what the first run received). Backward: its gradient sent back to ``src``. ``anchor``
    (an input that requires grad) puts the call in the graph; without gradients the call only receives."""

    @staticmethod
    def forward(ctx, anchor, template, replay, group, src):
        ctx.group, ctx.src = group, src
        with _unrecorded():
            if replay is not None:
                return replay.clone()
            buf = torch.empty_like(template)
            dist.recv(buf, src=src, group=group)
            return buf

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), dst=ctx.src, group=ctx.group)
        return None, None, None, None, None


class _Send(torch.autograd.Function):
    """Forward: ``message`` sent to rank ``dst`` (not when ``replay``: a checkpointed forward running again);
    returns a zero scalar that the caller adds to its output, so that backward reaches here. Backward: the
    message's gradient, received from ``dst``."""

    @staticmethod
    def forward(ctx, message, replay, group, dst):
        ctx.group, ctx.dst = group, dst
        ctx.meta = (message.shape, message.dtype, message.device)
        with _unrecorded():
            if not replay:
                dist.send(message.detach().contiguous(), dst=dst, group=group)
        return message.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        shape, dtype, device = ctx.meta
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=ctx.dst, group=ctx.group)
        return buf, None, None, None


@dataclass(frozen=True)
class _Message:
    """The parts of one boundary's message for one layer, in order, as ``(name, shape)``: float parts (in the
    compute dtype, differentiable) and integer parts (int64). ``n`` crossing documents."""

    floats: tuple[tuple[str, tuple[int, ...]], ...]
    ints: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, *, rows: int, k1: int, width: int, n: int, h: int, d: int, window: int, block: int,
           has_cache: bool) -> _Message:
        floats = [("tails", (3, rows, k1, width)), ("state", (n, h, d, d))]
        ints = []
        if has_cache:  # the cache's own layout (hola_titan/kernels/hola/cache.py)
            shapes = HolaCache.shapes(num_seqs=n, num_heads=h, head_dim=d, window=window, block=block)
            floats += [(name, shapes[name]) for name in HolaCache.TENSORS if name not in HolaCache.INTEGER]
            ints += [(name, shapes[name]) for name in HolaCache.INTEGER]
        return cls(floats=tuple(floats), ints=tuple(ints))

    @staticmethod
    def size(parts) -> int:
        return sum(math.prod(shape) for _, shape in parts)

    @staticmethod
    def pack(parts, values: dict, dtype) -> torch.Tensor:
        return torch.cat([values[name].reshape(-1).to(dtype) for name, _ in parts])

    @staticmethod
    def unpack(parts, flat: torch.Tensor) -> dict:
        out, at = {}, 0
        for name, shape in parts:
            size = math.prod(shape)
            out[name] = flat[at:at + size].view(shape)
            at += size
        return out


def message_bytes(*, rows: int, conv_size: int, heads: int, head_dim: int, window: int, block: int, evict: str,
                  crossing: int, float_bytes: int = 4) -> tuple[int, int]:
    """Bytes of one layer's messages across one boundary: ``(float message, integer message)``; floats in the
    compute dtype (``float_bytes``: 4 for bf16 and fp32 training), ``crossing`` documents, ``rows`` rows of tails."""
    spec = _Message.of(rows=rows, k1=conv_size - 1, width=heads * head_dim, n=crossing, h=heads, d=head_dim,
                       window=window, block=block, has_cache=evict != "none")
    return _Message.size(spec.floats) * float_bytes, _Message.size(spec.ints) * 8


class CPLayer:
    """One recurrent layer call under context parallelism (module docstring): :meth:`conv_tails` receives the
    message of rank r-1, :meth:`attention` runs the shard as its continuation and sends this rank's message to rank
    r+1. Made per call by ``CPBatch.layer(key)``; what it received is kept in the batch under ``key``, so that a
    forward re-run under activation checkpointing reads the same and sends nothing."""

    def __init__(self, cp: CPBatch, key, *, head_dim: int, settings: HolaSettings):
        self.cp, self.layout = cp, cp.layout
        self.head_dim, self.settings = head_dim, settings
        self.window, self.block, self.evict = settings.window, settings.block, settings.evict
        self._kept = cp._handover.setdefault(key, {})
        self.replay = "done" in self._kept
        r, layout = self.layout.cp_rank, self.layout
        self.chains_in = [c for c in range(layout.num_rows) if r > 0 and layout.first_offset[r][c] > 0]
        self.chains_out = [c for c in range(layout.num_rows) if layout.end_offset[r][c] > 0]
        self._received: dict | None = None
        self._tails_out: torch.Tensor | None = None

    def _message(self, *, tail_rows: int, width: int, n: int) -> _Message:
        """The message's parts: ``tail_rows`` rows of convolution tails (0 for a call of :meth:`attention`
        alone, without :meth:`conv_tails`), ``width = H D``, ``n`` crossing documents."""
        return _Message.of(rows=tail_rows, k1=self.cp.group.conv_size - 1, width=width, n=n,
                           h=width // self.head_dim, d=self.head_dim, window=self.window, block=self.block,
                           has_cache=self.evict != "none")

    # Under a compiled block, the two calls run eagerly (a graph break each): they read the batch's layout in Python
    # and send and receive; the block's other work (norms, convolutions, MLP) is still compiled.
    @torch.compiler.disable
    def conv_tails(self, xs: list[torch.Tensor], positions: torch.Tensor | None):
        """The previous shard's last ``K-1`` inputs of each short convolution and, per token, whether its
        document began on an earlier rank. Inputs of another document are zero in the tails. Receives this
        layer's message from rank r-1 (nothing when no document crosses into this shard)."""
        cp, layout = self.cp, self.layout
        if layout.packed and layout.num_rows > 1:
            raise ValueError("cu_seqlens: a packed cp shard must be one stream (shard_batch flattens packed rows)")
        r, k1 = cp.cp_rank, cp.group.conv_size - 1
        bsz, seq_len = xs[0].shape[:2]
        self._tails_out = torch.stack([x[:, seq_len - k1:] for x in xs])  # [3, B, K-1, H*D]
        device = xs[0].device
        if self.chains_in:
            self._received = self._receive(xs[0], tail_rows=bsz)
            tails = self._received["tails"].to(xs[0].dtype)
        else:
            tails = torch.zeros_like(self._tails_out)

        def masks():
            valid = torch.zeros(bsz, k1, dtype=torch.bool)
            continues = torch.zeros(bsz, seq_len, dtype=torch.bool)
            if r > 0:
                shard = layout.shard_len
                for c in range(layout.num_rows):
                    # The crossing document's tokens on rank r-1: all of them if it began earlier.
                    held = min(layout.end_offset[r - 1][c], shard)
                    valid[0 if layout.packed else c, max(0, k1 - held):] = held > 0
                for n in layout.in_seq:
                    if n >= 0:
                        start = layout.seq_start[n]
                        row, col = (0, start) if layout.packed else (n, 0)
                        continues[row, col:col + layout.seq_len[n]] = True
            return to_device(valid, device), to_device(continues, device)

        valid, continues = cp.memo(("conv", bsz, seq_len, k1, device), masks)
        tails = torch.where(valid[None, :, :, None], tails, 0)
        return list(tails.unbind(0)), continues

    def _receive(self, anchor: torch.Tensor, *, tail_rows: int) -> dict:
        """This layer's message from rank r-1, as named parts (a re-run reads the first run's); ``anchor``
        ``[B, T, H*D]``."""
        cp = self.cp
        spec = self._message(tail_rows=tail_rows, width=anchor.shape[-1], n=len(self.chains_in))
        cdt = compute_dtype(anchor.dtype)
        group, src = cp.group.mesh.get_group(), dist.get_global_rank(cp.group.mesh.get_group(), cp.cp_rank - 1)
        template = None
        if not self.replay:
            with _unrecorded():
                ints = torch.empty(_Message.size(spec.ints), dtype=torch.int64, device=anchor.device)
                if spec.ints:
                    dist.recv(ints, src=src, group=group)
                template = anchor.new_empty(_Message.size(spec.floats), dtype=cdt)
            cp.group.bytes_received += ints.numel() * 8 + template.numel() * template.element_size()
            self._kept["ints"] = ints
        if torch.is_grad_enabled() and not anchor.requires_grad:
            # Both sides of a boundary join the backward exchange whenever gradients are recorded, whatever needs a
            # gradient on either side (a frozen projection must not make one side skip the backward message).
            anchor = torch.zeros((), device=anchor.device, requires_grad=True)
        floats = _Receive.apply(anchor, template, self._kept.get("floats"), group, src)
        if not self.replay:
            self._kept["floats"] = floats.detach()
        return {**_Message.unpack(spec.floats, floats), **_Message.unpack(spec.ints, self._kept["ints"])}

    @torch.compiler.disable
    def attention(self, q, k, v, g, beta, gamma_q, gamma_k, sink, gate, *, documents: Documents | None = None,
                  cu_seqlens=None):
        """``hola_attention`` over this rank's shard, with the layer's settings, as the continuation of what rank
        r-1 sent (the module docstring): ``(o, None)``. Whole training rows only (no states or caches of a call);
        the settings' ``overlap_backward`` does not apply: shards run the layered form."""
        window, block, evict, backend = self.window, self.block, self.evict, self.settings.backend
        if cu_seqlens is not None:
            if documents is not None:
                raise ValueError("cu_seqlens: give cu_seqlens or documents, not both")
            documents = Documents.of(cu_seqlens, seq_len=q.shape[0] * q.shape[1], device=q.device)
        layout, cp = self.layout, self.cp
        _check_local(layout, q, documents)
        _, _, h, d = q.shape
        device, cdt, has_cache = q.device, compute_dtype(q.dtype), evict != "none"
        num_seqs = len(layout.seq_start)
        want_out = bool(self.chains_out)
        # A fresh call keeps its cache-read output with the setting; a continuing one forms delta over the keys.
        common = dict(window=window, block=block, evict=evict, backend=backend,
                      save_cache_output=self.settings.save_cache_output, scale=self.settings.scale,
                      mix=self.settings.mix)
        cache_params = (gamma_q, gamma_k, sink, gate)
        split = layout.packed and bool(self.chains_in) and num_seqs > 1
        # ``split``: the continuing document alone, as one row, then the documents that start in this shard as a
        # fresh packed call, which takes the fresh call's kernels (and no index maps over the other documents'
        # tokens). It was chosen when the Triton backend continued packed documents by a permutation of all the
        # call's tokens; that copy is gone (hola_titan.kernels.hola.continuation), and one continuing call for the
        # whole shard is a candidate to time against it. The continuing document is then not the one that crosses
        # out (that would be the shard's only document).
        initial_state = initial_cache = continuation = None
        if self.chains_in:
            if self._tails_out is None:  # attention alone: the message has no convolution tails
                self._received = self._receive(q.flatten(2), tail_rows=0)
            got = self._received
            n_call = 1 if split else num_seqs  # the sequences of the call that continues
            seqs = cp.memo(("seqs_in", device), lambda: to_device(
                torch.tensor([layout.in_seq[c] for c in self.chains_in], dtype=torch.int64), device))
            # Documents that start in this shard start from a zero state and an empty cache, as in one process.
            initial_state = q.new_zeros(n_call, h, d, d, dtype=cdt).index_copy(0, seqs, got["state"])
            if has_cache:
                fresh = HolaCache.empty(n_call, h, d, window=window, block=block, evict=evict, dtype=q.dtype,
                                        device=device, score_dtype=cdt)
                parts = {name: got[name].to(q.dtype) if name in HolaCache.ROWS else
                         got[name].detach() if name in HolaCache.SCORES else got[name] for name in HolaCache.TENSORS}
                initial_cache = HolaCache.unflatten(
                    [empty.index_copy(0, seqs, parts[name]) for name, empty in zip(HolaCache.TENSORS, fresh.flatten())],
                    fresh.meta())
                # The continuing call's index layout depends only on the tokens each sequence has seen (the
                # layout's offsets, on the host) and the shapes: made once for the batch, shared by its layers.
                continuation = cp.memo(("continuation", split, window, block, device), lambda: self._continuation(
                    split=split, shape=q.shape, device=device))
        if split:
            n0 = layout.seq_len[0]
            rest_docs = cp.memo(("rest_docs", device), lambda: Documents.from_host(
                torch.tensor([s - n0 for s in layout.local_cu_seqlens[1:]], dtype=torch.int64), device=device,
                seq_len=layout.shard_len - n0))
            o_first = hola_attention(*(x[:, :n0] for x in (q, k, v, g, beta)), *cache_params,
                                     initial_state=initial_state, initial_cache=initial_cache,
                                     continuation=continuation, **common)[0]
            result = hola_attention(*(x[:, n0:] for x in (q, k, v, g, beta)), *cache_params, documents=rest_docs,
                                    output_final_state=want_out, output_final_cache=want_out and has_cache, **common)
            result = (torch.cat([o_first, result[0]], dim=1), *result[1:])
        else:
            result = hola_attention(q, k, v, g, beta, *cache_params, documents=documents,
                                    initial_state=initial_state, initial_cache=initial_cache,
                                    continuation=continuation, output_final_state=want_out,
                                    output_final_cache=want_out and has_cache, **common)
        o = result[0]
        if want_out:
            # The final states and caches of the call's sequences (without the first one when split).
            o = o + self._send(result, q, shift=int(split)).to(o.dtype)  # a zero that carries backward to _Send
        self._kept["done"] = True
        return o, None

    def _continuation(self, *, split: bool, shape: torch.Size, device: torch.device):
        """The :class:`ContinuationLayout` of this shard's continuing call, from the host: every sequence of the call
        has seen its document's tokens before the shard (0 for documents that start here)."""
        from hola_titan.kernels.hola.continuation import ContinuationLayout
        layout = self.layout
        if split:  # the continuing document alone, as one row
            return ContinuationLayout.from_host([layout.seq_offset[0]], None, batch=1, seq_len=layout.seq_len[0],
                                                window=self.window, block=self.block, device=device)
        return ContinuationLayout.from_host(list(layout.seq_offset),
                                            layout.local_cu_seqlens if layout.packed else None, batch=shape[0],
                                            seq_len=shape[1], window=self.window, block=self.block, device=device)

    def _send(self, result, q: torch.Tensor, *, shift: int) -> torch.Tensor:
        """Sends this layer's message to rank r+1; returns ``_Send``'s zero token. ``result`` holds the final
        states and caches of the shard's sequences from ``shift`` on."""
        cp, layout, device = self.cp, self.layout, q.device
        h, d = q.shape[2:]
        seqs = cp.memo(("seqs_out", shift, device), lambda: to_device(
            torch.tensor([layout.out_seq[c] - shift for c in self.chains_out], dtype=torch.int64), device))
        tails = self._tails_out
        if tails is None:
            tails = q.new_zeros(3, 0, self.cp.group.conv_size - 1, h * d)
        spec = self._message(tail_rows=tails.shape[1], width=h * d, n=len(self.chains_out))
        values = {"tails": tails, "state": result[1].index_select(0, seqs)}
        if self.evict != "none":
            final = result[2].select(seqs)
            values.update((name, t.detach() if name in HolaCache.SCORES else t)
                          for name, t in zip(HolaCache.TENSORS, final.flatten()))
        group = cp.group.mesh.get_group()
        dst = dist.get_global_rank(group, cp.cp_rank + 1)
        if spec.ints and not self.replay:
            with _unrecorded():
                dist.send(_Message.pack(spec.ints, values, torch.int64), dst=dst, group=group)
        floats = _Message.pack(spec.floats, values, compute_dtype(q.dtype))
        if torch.is_grad_enabled() and not floats.requires_grad:  # as _receive: join the backward exchange
            floats = floats + torch.zeros((), dtype=floats.dtype, device=device, requires_grad=True)
        return _Send.apply(floats, self.replay, group, dst)


def _check_local(layout: CPLayout, q: torch.Tensor, documents: Documents | None) -> None:
    rows, shard = layout.num_rows, layout.shard_len
    expected = (1, rows * shard) if layout.packed else (rows, shard)
    if tuple(q.shape[:2]) != expected:
        raise ValueError(f"q: shape {list(q.shape)} does not match the cp layout {list(expected)} + [H, D]")
    if layout.packed != (documents is not None) or (
            documents is not None and documents.host.tolist() != layout.local_cu_seqlens):
        raise ValueError("cu_seqlens: differs from the cp layout's local sequences")


def context_parallel_for(args, cp_mesh: DeviceMesh) -> ContextParallel:
    """The :class:`ContextParallel` of a model with ``ModelArgs`` ``args`` over ``cp_mesh``. The model itself is
    not changed: every batch's :class:`CPBatch` reaches its layers through ``forward``."""
    return ContextParallel(cp_mesh, recurrent=args.is_recurrent, conv_size=args.conv_size)
