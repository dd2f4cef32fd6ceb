"""Document boundaries of one packed batch (``cu_seqlens``), checked once, with their host copy.

Shape legend: N documents; ``cu_seqlens`` is ``[N + 1]``, from 0 to T (the flattened tokens).

Reading a CUDA tensor's values on the host synchronises the host with the device: the GPU then idles while the
host issues the next launches (a third of a GDN layer's forward + backward when it happened per layer,
docs/LOG.md). Two readers need the values: ``hola_attention``'s argument check and fla's chunk indices. A
:class:`Documents` is made once per batch (by the trainer from the loader's host copy, or by the model from a
bare tensor, read once) and handed to every layer through ``forward``: it carries the checked device tensor,
its host copy and what every layer derives from it (fla's chunk indices), so no layer reads the device and
nothing about a batch lives outside the objects that batch's forward receives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


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
        chunk_indices = None
        if device.type == "cuda":
            from hola_titan.kernels.fla_gdn import chunk_indices_from_host, fla_available
            if fla_available():
                chunk_indices = chunk_indices_from_host(host, device)
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
        (:class:`~hola_titan.kernels.hola_triton_select.BlockTable`): made from the host copy and sent in one
        copy, once per batch (:meth:`derived`; inside a compiled region, built on the device with traceable
        operations)."""
        from hola_titan.kernels import hola_triton_select
        device = self.cu_seqlens.device
        return self.derived(
            ("block_table", block),
            lambda: hola_triton_select.block_table_from_host(self.host, block=block, device=device),
            traceable=lambda: hola_triton_select.build_block_table(1, self.seq_len, self.cu_seqlens, block, device))


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
