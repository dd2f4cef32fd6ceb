"""Document boundaries of one packed batch (``cu_seqlens``), checked once, with their host copy.

Shape legend: N documents; ``cu_seqlens`` is ``[N + 1]``, from 0 to T (the flattened tokens).

Reading a CUDA tensor's values on the host synchronises the host with the device: the GPU then idles while the
host issues the next launches (a third of a GDN layer's forward + backward when it happened per layer,
docs/LOG.md). Two readers need the values: ``hola_attention``'s argument check and fla's chunk indices. A
:class:`Documents` is made once per batch (by the trainer from the loader's host copy, or by the model from a
bare tensor, read once) and handed to every layer through ``forward``: it carries the checked device tensor,
its host copy and what every layer derives from it (fla's chunk indices, the HOLA block table), so no layer reads
the device and nothing about a batch lives outside the objects that batch's forward receives.

What is derived lives here, beside :class:`Documents`, and is made from the host copy in one copy to the device:
:func:`chunk_indices_from_host` for fla's chunked state path, and the block table (:class:`BlockTable`,
:func:`block_table_from_host`, :func:`build_block_table`) that the HOLA cache read's tiers all take
(:mod:`hola_titan.kernels.hola.selection` describes its layout). Nothing here imports the rest of the package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

# fla-core's chunk of the GDN state path (``fla.ops.utils.index.prepare_chunk_indices``'s chunk size): the
# chunk indices below are made for it.
CHUNK = 64


def _check_list(cu: list[int], seq_len: int) -> None:
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens: expected [N + 1] boundaries with N >= 1, got {len(cu)} values")
    if cu[0] != 0 or cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens: must start at 0 and end at T = {seq_len}, got {cu[0]} ... {cu[-1]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens: must be non-decreasing (monotone)")


def check_shape(cu_seqlens: torch.Tensor) -> None:
    """``ValueError`` naming ``cu_seqlens`` unless it is a 1-D int32/int64 tensor of at least two values."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: must be int32 or int64, got {cu_seqlens.dtype}")


@dataclass(frozen=True, eq=False)
class Documents:
    """The checked boundaries of one batch's documents over ``seq_len`` flattened tokens.

    ``cu_seqlens`` is int64 on the compute device (what fla takes, so no layer converts it); ``host`` is its
    int64 CPU copy; ``chunk_indices`` fla's chunk indices (on CUDA, where fla runs the state path; None
    elsewhere), made here once, outside any compiled region, for every layer of the batch. Immutable: a batch
    with other boundaries is another object.
    """

    cu_seqlens: torch.Tensor
    host: torch.Tensor
    seq_len: int
    chunk_indices: torch.Tensor | None
    # What the batch's layers derive from these boundaries alone (derived, block_table); filled once per batch.
    # An init field: torch's distributed wrappers rebuild dataclass inputs with dataclasses.replace (FSDP's input
    # casts), which must carry it over.
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_host(cls, host: torch.Tensor, *, device: torch.device | str, seq_len: int) -> Documents:
        """Check ``host`` (CPU boundaries) and send it to ``device`` without waiting (:func:`to_device`)."""
        if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
            raise ValueError(f"cu_seqlens: the host copy must be a CPU tensor, got {type(host).__name__} on "
                             f"{getattr(host, 'device', None)}")
        check_shape(host)
        # A copy: the caller may refill its tensor in place for the next batch (and fla memoises by identity).
        return cls._checked(host.to(torch.int64, copy=True), None, torch.device(device), seq_len)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, *, seq_len: int, device: torch.device | str | None = None) -> Documents:
        """Check a tensor on any device: a device tensor is read once (a synchronisation on CUDA) and those values
        become the host copy. The result lives on ``device`` (default: the tensor's); a tensor already there is
        kept (as int64), not sent back."""
        check_shape(cu_seqlens)
        device = torch.device(device) if device is not None else cu_seqlens.device
        if cu_seqlens.device.type == "cpu" or cu_seqlens.device != device:
            return cls.from_host(cu_seqlens.cpu(), device=device, seq_len=seq_len)
        return cls._checked(cu_seqlens.cpu().to(torch.int64), cu_seqlens.to(torch.int64), device, seq_len)

    @classmethod
    def _checked(cls, host: torch.Tensor, on_device: torch.Tensor | None, device: torch.device,
                 seq_len: int) -> Documents:
        """Check the int64 ``host`` values; ``on_device``: the same values already on ``device`` (None: sent)."""
        _check_list(host.tolist(), seq_len)
        # On CUDA, where fla runs the state path (a run on the reference backend leaves them unread).
        chunk_indices = chunk_indices_from_host(host, device) if device.type == "cuda" else None
        cu_seqlens = on_device if on_device is not None else to_device(host, device)
        return cls(cu_seqlens=_varying(cu_seqlens), host=host, seq_len=seq_len, chunk_indices=_varying(chunk_indices))

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def derived(self, key, make, *, traceable=None):
        """What the batch's layers derive from these boundaries alone (a block table, document ids), made by
        ``make()`` the first time ``key`` is asked for and kept with the batch. The model asks before its blocks
        run (outside any compiled region); a first request inside a compiled region is made there by
        ``traceable()`` (default ``make``) and not kept."""
        if key in self._derived:
            return self._derived[key]
        if torch.compiler.is_compiling():
            return (traceable or make)()
        value = self._derived[key] = _varying(make())
        return value

    def block_table(self, block: int):
        """The HOLA block table of these documents for blocks of ``block`` tokens
        (:class:`BlockTable`): made from the host copy and sent in one
        copy, once per batch (:meth:`derived`; inside a compiled region, built on the device with traceable
        operations)."""
        device = self.cu_seqlens.device
        return self.derived(
            ("block_table", block),
            lambda: block_table_from_host(self.host, block=block, device=device),
            traceable=lambda: build_block_table(1, self.seq_len, self.cu_seqlens, block, device))


def _varying(value):
    """Mark the first dimension of ``value``'s tensors (a tensor, a dataclass of them, or None) as one that varies
    from batch to batch: a compiled region then traces it as a symbol at its first batch, instead of specialising
    on the first batch's document count and recompiling at the second (Dynamo's automatic dynamic shapes): a second
    graph at step 2, 8 s of the 340M run's start on an H200 (2026-12-02). ``maybe``: a size of 1 may still
    specialise, as torch decides, without an error."""
    if value is None:
        return None
    tensors = [value] if isinstance(value, torch.Tensor) else [
        getattr(value, f.name) for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return value


def to_device_aligned(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU ``tensors`` on ``device`` in one copy (:func:`to_device`), as views of one buffer in which each starts on
    a 16-byte boundary. Triton specialises a pointer argument on its 16-byte alignment: packed back to back, a
    tensor's alignment would follow the sizes of those before it, and the kernels that read it would compile again
    whenever a batch changes them (seen on the H200: three kernels compiled again at the second step of a 340M
    run)."""
    chunks = []
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        chunks.append(torch.cat([raw, raw.new_zeros(-raw.numel() % 16)]))
    sent = to_device(torch.cat(chunks), torch.device(device))
    out, offset = [], 0
    for t, chunk in zip(tensors, chunks):
        out.append(sent[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        offset += chunk.numel()
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; to a GPU through pinned memory, without waiting (a copy from
    pageable memory waits for the device's queue). The caching host allocator keeps the pinned block until the
    copy is done."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# ----------------------------------------------------------------------------------------------------------------
# What every layer of a batch derives from its boundaries alone: fla's chunk indices and the HOLA block table.


def chunk_indices_from_host(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fla's chunk indices (``[chunks, 2]``: each chunk's sequence and its index in the sequence, in the boundaries'
    dtype; what ``fla.ops.utils.index.prepare_chunk_indices`` returns, tested equal) of boundaries given on the
    host (no read of a device tensor), on ``device``: made once per batch by
    :class:`Documents` and passed to every layer."""
    # Made with numpy from the host copy, not with fla's function: in an H200 step profile (bench_train --profile,
    # docs/LOG.md 2026-12-04) the host spent 2.6-7.2 ms of each step's start, with the GPU idle, inside the
    # torch.repeat_interleave of fla's CPU path (about 0.1 ms on a development machine). numpy's repeat runs on
    # the calling thread.
    bounds = host.numpy().astype(np.int64)
    counts = -(-(bounds[1:] - bounds[:-1]) // CHUNK)
    seq = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    made = np.stack([seq, np.arange(seq.shape[0], dtype=np.int64) - first], axis=1)
    # Sent with a pinned, non-blocking copy: a copy from pageable memory waits for the device
    # (tests/test_step_gpu.py caught it).
    return to_device(torch.from_numpy(made).to(host.dtype), device)


@dataclass
class BlockTable:
    """Blocks of every sequence, as int32 tensors on the inputs' device (the layout is described in
    :mod:`hola_titan.kernels.hola.selection`'s docstring).

    The table has a static number of rows (``B * ceil(T / C)``, or ``ceil(T / C) + N`` with ``cu_seqlens``, an
    upper bound on the number of blocks), so building it needs no host synchronisation and traces under
    ``torch.compile``; rows past the last real block have ``blk_len == 0`` and are skipped by every kernel.
    """

    blk_start: torch.Tensor  # [NB] flat index of the block's first token
    blk_len: torch.Tensor  # [NB] tokens in the block (1 ... C; 0 for padding rows)
    blk_doc_start: torch.Tensor  # [NB] flat index of the first token of the block's sequence
    doc_start: torch.Tensor  # [N]
    doc_len: torch.Tensor  # [N]
    doc_first_blk: torch.Tensor  # [N]
    doc_num_blk: torch.Tensor  # [N]
    block: int
    # Results that depend on the table alone (select_recency), kept for the other layers of a batch that share it.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    FIELDS = ("blk_start", "blk_len", "blk_doc_start", "doc_start", "doc_len", "doc_first_blk", "doc_num_blk")
    """The tensor fields (``block`` and ``derived`` aside)."""

    @property
    def num_blocks(self) -> int:
        return self.blk_start.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.doc_start.shape[0]


def build_block_table(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, block: int,
                      device: torch.device) -> BlockTable:
    """The block table of ``batch`` rows of ``seq_len`` tokens, or of the documents of ``cu_seqlens`` (B == 1)."""
    if cu_seqlens is None:
        doc_start = torch.arange(batch, dtype=torch.int64, device=device) * seq_len
        doc_len = torch.full((batch,), seq_len, dtype=torch.int64, device=device)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        doc_start, doc_len = cu[:-1], cu[1:] - cu[:-1]
    return block_table_of_docs(doc_start, doc_len, num_block_rows(batch, seq_len, cu_seqlens, block), block)


def block_table_from_host(host: torch.Tensor, *, block: int, device: torch.device) -> BlockTable:
    """The table of :func:`build_block_table` for the documents of ``host`` (CPU boundaries ``[N + 1]``, one
    packed row), computed on the host and sent to ``device`` in one copy: what a batch's
    :class:`Documents` builds once for all its layers, instead of some thirty small
    device operations in every layer."""
    host = host.to(torch.int64)
    on_host = build_block_table(1, int(host[-1]), host, block, torch.device("cpu"))
    sent = to_device_aligned([getattr(on_host, name) for name in BlockTable.FIELDS], device)
    return BlockTable(**dict(zip(BlockTable.FIELDS, sent)), block=block)


def num_block_rows(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, block: int) -> int:
    """The rows of :func:`build_block_table`'s table, from shapes alone (an upper bound on the blocks with
    ``cu_seqlens``: every document can add one partial block)."""
    nb_row = -(-seq_len // block)
    return batch * nb_row if cu_seqlens is None else nb_row + cu_seqlens.shape[0] - 1


def block_table_of_docs(doc_start: torch.Tensor, doc_len: torch.Tensor, num_rows: int, block: int) -> BlockTable:
    """The block table of documents at flat ``doc_start`` with ``doc_len`` tokens (int64 tensors), in sequence
    order, with ``num_rows`` rows (an upper bound on the number of blocks, known without reading the lengths)."""
    device = doc_start.device
    doc_num_blk = (doc_len + block - 1) // block
    doc_end_blk = torch.cumsum(doc_num_blk, 0)
    doc_first_blk = doc_end_blk - doc_num_blk
    rows = torch.arange(num_rows, dtype=torch.int64, device=device)
    blk_doc = torch.searchsorted(doc_end_blk, rows, right=True).clamp(max=doc_start.shape[0] - 1)
    blk_in_doc = rows - doc_first_blk[blk_doc]
    real = rows < doc_end_blk[-1]
    blk_start = torch.where(real, doc_start[blk_doc] + blk_in_doc * block, torch.zeros_like(rows))
    blk_len = torch.where(real, (doc_len[blk_doc] - blk_in_doc * block).clamp(0, block), torch.zeros_like(rows))
    i32 = torch.int32
    return BlockTable(blk_start=blk_start.to(i32), blk_len=blk_len.to(i32), blk_doc_start=doc_start[blk_doc].to(i32),
                      doc_start=doc_start.to(i32), doc_len=doc_len.to(i32), doc_first_blk=doc_first_blk.to(i32),
                      doc_num_blk=doc_num_blk.to(i32), block=block)
