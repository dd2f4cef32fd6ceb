"""Document boundaries (``cu_seqlens``) checked once, with their host copy, so a step reads none from the device.

Shape legend: N documents; ``cu_seqlens`` is ``[N + 1]``, from 0 to T (the flattened tokens).

Reading a CUDA tensor's values on the host synchronises the host with the device: the GPU then idles while the
host issues the next launches (a third of a GDN layer's forward + backward when it happened per layer,
docs/LOG.md). Two readers need the values: ``hola_attention``'s argument check and fla's chunk indices. This
module remembers the last checked tensor (by identity and version counter; a model passes one tensor to every
layer) and, when the caller registered one, its host copy, so that neither reads the device:

- :func:`check_values` checks a tensor once (reading it if it is on the device and unregistered);
- :func:`register` (the trainer, once per batch) checks the host copy and registers the device tensor with it;
- :func:`host_copy` hands the host copy to fla (``cu_seqlens_cpu``);
- :func:`derived` keeps a value made from the host copy (fla's chunk indices) for every layer of the batch;
- :func:`to_device` sends a tensor made on the host to the device without waiting.
"""

from __future__ import annotations

import weakref

import torch

# (weak reference to the checked tensor, its version counter or None, T, host copy or None, derived values)
_LAST: tuple | None = None


def _version(cu_seqlens: torch.Tensor):
    # Inference tensors (made under torch.inference_mode) keep no version counter: they are known by identity.
    return None if cu_seqlens.is_inference() else cu_seqlens._version


def _check_list(cu: list[int], seq_len: int) -> None:
    if cu[0] != 0 or cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens: must start at 0 and end at T = {seq_len}, got {cu[0]} ... {cu[-1]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens: must be non-decreasing (monotone)")


def _is_last(cu_seqlens: torch.Tensor) -> bool:
    last = _LAST
    return last is not None and last[0]() is cu_seqlens and last[1] == _version(cu_seqlens)


def check_values(cu_seqlens: torch.Tensor, seq_len: int) -> None:
    """``ValueError`` naming ``cu_seqlens`` unless it runs from 0 to ``seq_len`` without decreasing; each tensor
    is read once (and not at all when registered with its host copy)."""
    global _LAST
    if torch.compiler.is_compiling():
        return  # values are data under tracing; the eager path and the trainer check them
    if _is_last(cu_seqlens) and _LAST[2] == seq_len:
        return
    _check_list(cu_seqlens.tolist(), seq_len)
    _LAST = (weakref.ref(cu_seqlens), _version(cu_seqlens), seq_len, None, {})


def register(cu_seqlens: torch.Tensor, *, host: torch.Tensor, seq_len: int) -> None:
    """Check ``host`` (a CPU copy of ``cu_seqlens``) and register ``cu_seqlens`` with it (see the module
    docstring); raises like :func:`check_values`."""
    global _LAST
    if host.device.type != "cpu" or host.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens: the host copy must be a CPU tensor of shape {list(cu_seqlens.shape)}, got "
                         f"{host.device} {list(host.shape)}")
    _check_list(host.tolist(), seq_len)
    _LAST = (weakref.ref(cu_seqlens), _version(cu_seqlens), seq_len, host.to(torch.int64), {})


def host_copy(cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """The registered host copy of ``cu_seqlens`` (int64), or None."""
    return _LAST[3] if _is_last(cu_seqlens) else None


def derived(cu_seqlens: torch.Tensor, key, make):
    """``make(host copy)``, made once per registration of ``cu_seqlens`` and kept under ``key``; None when
    ``cu_seqlens`` is not the registered tensor."""
    if not _is_last(cu_seqlens) or _LAST[3] is None:
        return None
    values = _LAST[4]
    if key not in values:
        values[key] = make(_LAST[3])
    return values[key]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; to a GPU through pinned memory, without waiting (a copy from
    pageable memory waits for the device's queue). The caching host allocator keeps the pinned block until the
    copy is done."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
