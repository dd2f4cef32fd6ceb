"""Which kernels run: the decisions of ``hola_attention`` and the trainer in one place, each with its reason.

Three decisions, each a function whose answer (and, where it falls back, why) the callers log or pass on:
- the attention backend a model or a call can use on a device (:func:`resolve_backend`; :func:`explain_backend`
  adds the reason an ``"auto"`` choice fell back, and the trainer logs it once per model and writes it to the run
  folder);
- the path one call takes (:func:`call_path`): a decoding step, the reference, the Triton backend, or the SDPA
  backend (the Triton backend itself decides whether ``overlap_backward`` runs the layer as one op:
  :func:`hola_titan.kernels.hola.triton_layer.applies`);
- the fused short-convolution and cross-entropy kernels (:func:`resolve_kernels`, ``model.kernels``).
What the kernels take (head dims, dtypes) and whether they can run here (Triton importable, fla-core present,
Triton's interpreter) are answered here too, once per process.
"""

from __future__ import annotations

import functools

import torch

from hola_titan.kernels.hola import selection as _select

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    return _select.triton is not None


@torch.compiler.assume_constant_result
def interpreting() -> bool:
    """Whether this process's Triton kernels run in Triton's interpreter (CPU tensors). Triton decides when a
    kernel is defined (``TRITON_INTERPRET=1`` in the environment when these modules are imported), so the answer
    is read from a kernel itself, once, and is fixed for the process; nothing reads the environment later."""
    return _interpreting()


@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    if not triton_importable():
        return False
    from hola_titan.kernels.hola import triton_kernels
    return type(triton_kernels._rstd_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _gpu_kernels_available() -> bool:
    from hola_titan.kernels.gdn.fla_bridge import fla_available
    return triton_importable() and fla_available()


@torch.compiler.assume_constant_result
def gpu_kernels_available() -> bool:
    """Triton and the pinned fla-core import (what the Triton and SDPA backends need on CUDA)."""
    return _gpu_kernels_available()


def is_supported(q: torch.Tensor) -> bool:
    """Whether the Triton and SDPA backends take inputs like ``q`` (head dim and dtype)."""
    return q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in SUPPORTED_DTYPES


def check_supported(q: torch.Tensor, backend: str) -> None:
    """``ValueError`` naming the argument when the Triton or SDPA backend cannot take these inputs."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim {d} is not supported by backend {backend!r}; use one of {SUPPORTED_HEAD_DIMS} "
                         "or backend='reference'")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not supported by backend {backend!r}; use float16, bfloat16 or "
                         "float32, or backend='reference'")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs on ``device``: ``"auto"`` is ``"triton"`` on CUDA, ``"reference"`` elsewhere.

    ``"triton"`` needs a CUDA device and the Triton kernels with fla-core, or a CPU under ``TRITON_INTERPRET=1``
    (tests: the kernels run in Triton's interpreter, with the fp32 reference state path in place of fla);
    ``"sdpa"`` needs fla-core on CUDA and runs anywhere else with the reference state path; ``"fa4"`` (the cache
    read on FlashAttention-4, :mod:`hola_titan.kernels.hola.fa4`) needs an sm_90 GPU, fla-core and the pinned
    flash-attn-4 (``pip install 'hola-titan[fa4]'``), and is never what ``"auto"`` picks. Raises
    ``ValueError`` naming ``backend`` when the requested one cannot run here.
    """
    device = torch.device(device)
    if backend == "reference":
        return backend
    on_cuda = device.type == "cuda"
    gpu_ready = on_cuda and gpu_kernels_available()
    if backend == "auto":
        return "triton" if on_cuda and gpu_ready else "reference"
    if on_cuda and not gpu_ready:
        raise ValueError(f"backend: {backend!r} on CUDA needs triton and fla-core; use 'reference'")
    if backend == "fa4":
        from hola_titan.kernels.hola.fa4 import fa4_problem
        problem = fa4_problem(device)
        if problem is not None:
            raise ValueError(f"backend: 'fa4' cannot run here: {problem}; use 'triton' or 'auto'")
    if backend == "triton" and not on_cuda and not (interpreting() and triton_importable()):
        raise ValueError("backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 with triton installed); "
                         "use 'reference' or 'auto'")
    return backend


def explain_backend(backend: str, device: torch.device, *, head_dim: int,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """``(backend that runs, why)`` for a model of head dim ``head_dim`` on ``device``, resolved once at build.

    Unlike :func:`resolve_backend` (what a call can use), this names the reason an ``"auto"`` choice fell back:
    no CUDA device, fla-core missing or not the pinned version, Triton not importable, a head dim or dtype the
    kernels do not take. An explicit backend that cannot run raises ``ValueError`` as there.
    """
    device = torch.device(device)
    chosen = resolve_backend(backend, device)
    if chosen == "fa4":
        from hola_titan.kernels.hola.fa4 import fa4_problem
        problem = fa4_problem(device, head_dim=head_dim, dtype=dtype)
        if problem is not None:
            raise ValueError(f"backend: 'fa4': {problem}; use 'triton'")
        return chosen, "as set: the cache read on FlashAttention-4 (hola_titan/kernels/hola/fa4.py)"
    if chosen in ("triton", "sdpa"):
        if head_dim not in SUPPORTED_HEAD_DIMS or dtype not in SUPPORTED_DTYPES:
            problem = f"head dim {head_dim} / {dtype} is not taken by the kernels (head dims {SUPPORTED_HEAD_DIMS})"
            if backend != "auto":
                raise ValueError(f"backend: {backend!r}: {problem}; use 'reference'")
            return "reference", f"auto: {problem}"
        why = "as set" if backend != "auto" else ("CUDA with Triton and fla-core" if device.type == "cuda" else
                                                   "Triton's interpreter")
        return chosen, why
    if backend != "auto":
        return chosen, "as set"
    if device.type != "cuda":
        return chosen, "auto: no CUDA device"
    from hola_titan.kernels.gdn.fla_bridge import FLA_VERSION, fla_version
    found = fla_version()
    if not triton_importable():
        return chosen, "auto: Triton does not import"
    if found is None:
        return chosen, f"auto: fla-core is not installed (the state path needs fla-core=={FLA_VERSION})"
    if found != FLA_VERSION:
        return chosen, f"auto: fla-core {found} is installed, the adapter is written against {FLA_VERSION}"
    return chosen, "auto: fla-core's kernels do not import"


KERNELS = ("auto", "triton", "reference")


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """``model.kernels`` for ``device``: ``"triton"`` (the fused short convolution and cross-entropy kernels) or
    ``"reference"`` (their PyTorch forms). ``"auto"`` is ``"triton"`` on CUDA with Triton installed; ``"triton"``
    also runs on a CPU under ``TRITON_INTERPRET=1`` (tests). Raises ``ValueError`` naming ``kernels`` when the
    requested one cannot run here."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: unknown {kernels!r}; expected one of {KERNELS}")
    device = torch.device(device)
    if kernels == "reference":
        return kernels
    if kernels == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "reference"
    if not triton_importable() or not (device.type == "cuda" or interpreting()):
        raise ValueError("kernels: 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on a CPU); use "
                         "'reference' or 'auto'")
    return kernels


def call_path(backend: str, chosen: str, q: torch.Tensor, *, decoding: bool, initial_cache) -> tuple[str, str]:
    """``(path, why)`` of one ``hola_attention`` call: ``"decode_step"``, ``"reference"``, ``"triton"``,
    ``"sdpa"`` or ``"fa4"``. ``chosen`` is :func:`resolve_backend`'s answer for the call's device; ``decoding``:
    the call is a single decoding step (:func:`hola_titan.kernels.hola.decode.applies`)."""
    if chosen != "reference" and not is_supported(q):
        if backend != "auto":
            check_supported(q, chosen)  # raises, naming what the kernels do not take
        chosen, why = "reference", f"auto: head dim {q.shape[-1]} / {q.dtype} is not taken by the kernels"
    else:
        why = "as set" if backend != "auto" else f"auto: {chosen} on {q.device.type}"
    if backend != "reference" and decoding:
        return "decode_step", "one token per row continuing from a state and a cache, no gradient"
    if chosen in ("sdpa", "fa4") and initial_cache is not None:
        return "reference", (f"{chosen} starts from an empty cache: a call continuing from a cache runs the "
                             "reference")
    if chosen == "fa4":
        from hola_titan.kernels.hola.fa4 import fa4_problem
        problem = fa4_problem(q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if problem is not None:  # an fa4 model given inputs its kernels do not take: refused, not run elsewhere
            raise ValueError(f"backend: 'fa4' cannot take these inputs: {problem}")
    return chosen, why
