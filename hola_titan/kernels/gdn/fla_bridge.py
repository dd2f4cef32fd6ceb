"""The GDN state path through fla-core, with the HOLA surprise score from the same pass (DESIGN §1, items 3-4).

Shape legend: B batch, T tokens, H heads, K = V = D head dim, N sequences.

A thin adapter over fla-core's internal stages (imported, never copied; pinned to ``FLA_VERSION``): the forward
calls the stages of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with the in-kernel l2norm in the same
order, so ``o`` is bit-identical to the public op, and keeps the per-token update ``v_new = beta_t e_t`` that
fla computes and drops, whose norm is the score ``m_t = beta_t ||e_t||`` (float32, detached). The backward is
fla's ``chunk_gated_delta_rule_bwd`` unchanged (the score takes no gradient), except from an incoming state: there
its stages run in the same order with the initial state's gradient formed outside fla's kernel
(:func:`_bwd_from_initial_state` says why). Both directions are
``torch.library`` custom ops, so a compiled block does not graph-break around fla's ``compiler.disable``.

What the backward keeps: fla's own op saves the l2-normalised ``qn``, ``kn`` and their reciprocal norms. A caller
that keeps the raw ``q`` and ``k`` for its own backward anyway (HOLA's cache path) passes ``recompute_norms=True``:
the op then saves those same raw tensors (one copy in memory for both) and recomputes the two l2norms in backward
(fla's kernel again, so the gradients are bitwise those of the default), at 3 GiB less for the 340M model at
2,048 x 16 tokens a step, for two light passes over q and k per layer.

fla issue #640. Triton >= 3.4 and < 3.7.1 miscompiles fla's gated ``chunk_bwd_dqkwg`` on Hopper with 64-wide K
tiles, and fla 0.6.0 raises there. fla tiles K (and V) at 128 on Hopper when the head dim is at least 128, the
configuration whose results were checked. This module therefore, on Hopper with such a Triton:
- zero-pads q, k, v (and the initial state) to a head dim of 128 when D < 128 (l2norm, k^T k, the state's real
  block and the score are unchanged by zero padding; the scale stays D^-1/2; outputs are sliced back);
- before the first backward at a head dim, runs :func:`check_fla_backward` (fla's backward against this
  project's float64 reference at HOLA's decay ranges, on the running GPU, with the kernels the run itself will
  launch: its heads, compute dtype and row layout) and lifts fla's guard, only inside fla's backward call and only
  for head dims whose check passed, logging that it did so;
- raises if the check fails. Nothing is patched silently or globally.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hola_titan.kernels.gdn.reference import gated_delta_chunked, l2norm, sequence_layout, to_rows
from hola_titan.kernels.runtime.documents import CHUNK

FLA_VERSION = "0.6.0"
PAD_HEAD_DIM = 128
# Relative RMS error allowed per tensor in the #640 check: fla's bf16 kernels land near 5e-3 against fp32 (this
# project's H200 checks in docs/LOG.md: 4.0e-3 to 8.1e-3 on 2026-12-01), so 5e-2 leaves 10x for bf16 rounding at
# other shapes; a miscompiled tile gives errors of order one.
CHECK_TOLERANCE = 5e-2

logger = logging.getLogger(__name__)

_CHECKED: dict[tuple[int, int], dict[str, float]] = {}


def fla_version() -> str | None:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def fla_available() -> bool:
    """True when the pinned fla-core and Triton import (the device may still be unsupported)."""
    if fla_version() != FLA_VERSION:
        return False
    try:
        import fla.ops.gated_delta_rule.chunk  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the fla path is unavailable
        return False
    return True


def _require_fla() -> None:
    version = fla_version()
    if version != FLA_VERSION:
        raise RuntimeError(f"the HOLA fla adapter is written against fla-core=={FLA_VERSION}, found {version}; "
                           "its internal stages move between releases")


def _triton_version() -> tuple[int, ...]:
    import triton
    return tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3] if x.isdigit())


@torch.compiler.assume_constant_result
def guard_applies(device: torch.device) -> bool:
    """Whether fla 0.6.0's #640 guard fires here: a Hopper GPU with 3.4 <= Triton < 3.7.1."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and (3, 4) <= _triton_version() < (3, 7, 1)


def padded_head_dim(d: int, device: torch.device) -> int:
    return max(d, PAD_HEAD_DIM) if guard_applies(device) else d


@contextlib.contextmanager
def fla_backward_allowed(head_dim: int, device: torch.device):
    """Lift fla's #640 guard for one backward call, only for a head dim whose gradient check passed."""
    if not guard_applies(device):
        yield
        return
    key = (torch.device(device).index or 0, head_dim)
    if key not in _CHECKED:
        raise RuntimeError(f"fla #640: no passing gradient check for head dim {head_dim} on this GPU; "
                           "call hola_titan.kernels.gdn.fla_bridge.ensure_backward_checked before compiling")
    import fla.ops.common.chunk_o as chunk_o
    saved = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = saved


# ----------------------------------------------------------------------------------------------------------------
# Reference state path (pure PyTorch, differentiable): for CPU runs and for the #640 check.


def reference_gdn_with_scores(q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, output_final_state=False,
                              scale: float | None = None):
    """GDN through the fp32 reference: ``(o_state [B,T,H,D] float32, m [B,T,H] float32, final_state or None)``;
    ``scale`` the state read's factor (None: ``D^-1/2``)."""
    bsz, seq_len, h, d = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    index, _ = sequence_layout(bsz, seq_len, cu_seqlens, q.device)
    n = index.shape[0]

    def flat(x):
        x = x.reshape(bsz * seq_len, *x.shape[2:]).to(cdt)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)

    q_f, k_f, v_f, g_f, beta_f = map(flat, (q, k, v, g, beta))
    state0 = torch.zeros(n, h, d, d, dtype=cdt, device=q.device) if initial_state is None else initial_state.to(cdt)
    o_rows, e_rows, final_state = gated_delta_chunked(
        to_rows(l2norm(q_f), index), to_rows(l2norm(k_f), index), to_rows(v_f, index), to_rows(g_f, index),
        to_rows(beta_f, index), state0, d ** -0.5 if scale is None else scale)
    valid = index < bsz * seq_len
    m_rows = e_rows.detach().norm(dim=-1) * to_rows(beta_f, index).detach()
    o = torch.zeros(bsz * seq_len, h, d, dtype=cdt, device=q.device).index_put((index[valid],), o_rows[valid])
    m = torch.zeros(bsz * seq_len, h, dtype=cdt, device=q.device).index_put((index[valid],), m_rows[valid])
    return (o.view(bsz, seq_len, h, d), m.view(bsz, seq_len, h).to(torch.float32),
            final_state if output_final_state else None)


def hola_decay(shape, device, generator=None) -> torch.Tensor:
    """Log-decays drawn as HOLA initialises them: ``-exp(A_log) softplus(a + dt_bias)`` (DESIGN §1, item 2)."""
    b, t, h = shape
    a_log = torch.log(torch.empty(h, device=device).uniform_(1, 16, generator=generator))
    dt = torch.exp(torch.empty(h, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = torch.randn(b, t, h, device=device, generator=generator)
    return -torch.exp(a_log) * F.softplus(a + dt_bias)


def verdict_path(cache_folder: str | Path, head_dim: int, device: torch.device, num_heads: int = 4,
                 dtype: torch.dtype = torch.bfloat16, packed: bool = True) -> Path:
    """Where the #640 check's verdict for this GPU, head dim, the check's kernels (heads, dtype, row layout) and
    fla / Triton / torch versions is kept."""
    from hola_titan.kernels.runtime.tuned_configs import active_tag, sanitize_gpu_name, versions

    v = versions()
    # The configurations the kernels run with are part of what was checked (a miscompile is per configuration).
    kind = f"d{head_dim}_h{num_heads}_{str(dtype).removeprefix('torch.')}_{'packed' if packed else 'rows'}"
    name = (f"fla640__{sanitize_gpu_name(torch.cuda.get_device_name(device))}__fla-{v['fla']}__triton-{v['triton']}"
            f"__torch-{v['torch']}__{kind}__configs-{active_tag()}.json")
    return Path(cache_folder).expanduser() / name


def read_verdict(path: Path) -> dict[str, float] | None:
    """A recorded passing verdict (relative errors by tensor), or None when absent, unreadable, recorded under
    another tolerance, or not passing: the check then runs again."""
    try:
        data = json.loads(path.read_text())
        errors = {str(k): float(e) for k, e in data["errors"].items()}
        tolerance = float(data["tolerance"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    names = {"o", "dq", "dk", "dv", "dg", "dbeta"}
    if tolerance != CHECK_TOLERANCE or set(errors) != names or not all(e <= CHECK_TOLERANCE for e in errors.values()):
        return None
    return errors


def write_verdict(path: Path, errors: dict[str, float]) -> None:
    """Keep a passing verdict for the next process on this node (written whole, then renamed into place)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"errors": errors, "tolerance": CHECK_TOLERANCE,
                                   "written": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        os.replace(tmp, path)
    except OSError as err:  # an unwritable cache folder costs the next process a check, nothing else
        logger.warning("fla #640: could not keep the check's verdict in %s (%s)", path, err)


def check_fla_backward(head_dim: int, device: torch.device, *, num_heads: int = 4,
                       dtype: torch.dtype = torch.bfloat16, packed: bool = True, seed: int = 0,
                       cache_folder: str | Path | None = None) -> dict[str, float]:
    """fla's forward and backward against the float64 reference, on ``device``, with the kernels a run launches.

    ``num_heads`` heads of ``head_dim`` in ``dtype`` (fla compiles per head count, head dim and dtype), and
    ``packed``: documents of 300, 1 and 339 tokens in one row (partial chunks, a length-1 document), else two rows
    of 320 tokens (fla's plain-row kernels; 640 tokens either way, a multiple of 16 as the recipes' lengths are, so
    that the check compiles what the run's first step then finds compiled). Decays drawn as HOLA initialises them,
    no initial or final state (as in training). Records and returns the relative RMS error of o and every
    gradient; raises ``RuntimeError`` when one exceeds ``CHECK_TOLERANCE``. ``cache_folder``: a passing verdict
    recorded there for this GPU model, the check's kernels and fla / Triton / torch versions is taken instead of
    running the check again (the check's inputs are fixed by ``seed``, so it would give the same numbers), and a
    new passing verdict is recorded there.
    """
    _require_fla()
    device = torch.device(device)
    path = verdict_path(cache_folder, head_dim, device, num_heads, dtype, packed) if cache_folder else None
    recorded = read_verdict(path) if path is not None and seed == 0 else None
    if recorded is not None:
        _CHECKED[(device.index or 0, head_dim)] = recorded
        logger.warning("fla #640: guard lifted for head dim %d on %s by the passing check recorded in %s "
                       "(relative errors %s)", head_dim, torch.cuda.get_device_name(device), path,
                       {k_: f"{e:.1e}" for k_, e in recorded.items()})
        return recorded
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [300, 1, 339]
    if packed:
        b, t = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)
    else:
        b, t, cu = 2, 320, None
    h, d = num_heads, head_dim

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k, v = (rand(b, t, h, d).to(dtype) for _ in range(3))
    g = hola_decay((b, t, h), device, generator=gen)
    beta = torch.sigmoid(rand(b, t, h))
    do = rand(b, t, h, d)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    # The check may first run inside a model's forward: its own graph must not see the caller's autocast, and
    # its saved tensors must not enter an activation-checkpointed region's (identity hooks shadow the region's,
    # whose recomputation would otherwise find extra saved tensors and fail its metadata check).
    isolated = contextlib.ExitStack()
    isolated.enter_context(torch.enable_grad())
    isolated.enter_context(torch.autocast(device.type, enabled=False))
    isolated.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x))
    began = time.perf_counter()
    with isolated:
        _CHECKED[(device.index or 0, d)] = {}  # lets the guarded call run once, for the check itself
        try:
            o, _, _ = _GDNFunction.apply(*leaves, None, cu, None, d ** -0.5, False)
            o.backward(do.to(o.dtype))
        finally:
            del _CHECKED[(device.index or 0, d)]
        torch.cuda.synchronize(device)
        fla_seconds = time.perf_counter() - began
        ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
        o_r, _, _ = reference_gdn_with_scores(*ref_leaves, cu_seqlens=cu)
        o_r.backward(do.double())
    errors = {"o": _rel(o, o_r)}
    for name, x, x_r in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, ref_leaves):
        errors[name] = _rel(x.grad, x_r.grad)
    bad = {k_: e for k_, e in errors.items() if not e <= CHECK_TOLERANCE}
    if bad:
        raise RuntimeError(f"fla #640 gradient check failed at head dim {d} on {torch.cuda.get_device_name(device)}: "
                           f"relative errors {bad} exceed {CHECK_TOLERANCE}; fla's gated backward is not usable here")
    _CHECKED[(device.index or 0, d)] = errors
    logger.warning("fla #640: guard lifted for head dim %d on %s after a gradient check against the float64 "
                   "reference (%d heads, %s, %s; relative errors %s; %.1f s, of which fla's forward and backward "
                   "%.1f s)%s", d, torch.cuda.get_device_name(device), h, str(dtype).removeprefix("torch."),
                   "packed documents" if packed else "plain rows", {k_: f"{e:.1e}" for k_, e in errors.items()},
                   time.perf_counter() - began, fla_seconds, f"; verdict kept in {path}" if path else "")
    if path is not None and seed == 0:
        write_verdict(path, errors)
    return errors


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def ensure_backward_checked(head_dim: int, device: torch.device, *, num_heads: int = 4,
                            dtype: torch.dtype = torch.bfloat16, packed: bool = True,
                            cache_folder: str | Path | None = None) -> None:
    """Run the #640 check once per GPU and head dim where fla's guard applies (or take the verdict kept in
    ``cache_folder``, see :func:`check_fla_backward`).

    Eager calls of :func:`gdn_with_scores` run it on their own; a compiled model must call it before tracing
    (the check runs real kernels and autograd), else its backward raises and names this function.
    """
    if guard_applies(device) and ((torch.device(device).index or 0), head_dim) not in _CHECKED:
        check_fla_backward(head_dim, device, num_heads=num_heads, dtype=dtype, packed=packed,
                           cache_folder=cache_folder)


def prepare_backward(head_dim: int, device: torch.device, *, num_heads: int = 4, dtype: torch.dtype = torch.bfloat16,
                     packed: bool = True, cache_folder: str | Path | None = None) -> None:
    """Before training a model of head dim ``head_dim`` on ``device``: run the #640 check now if it applies.

    The trainer calls this before compiling (a compiled backward cannot run the check) and before the first
    forward (so the check does not run inside an activation-checkpointed block). No-op without fla or the guard.
    ``num_heads`` (per rank), ``dtype`` (the compute dtype) and ``packed`` (documents in a row, or plain rows):
    the run's, so that the check runs, and compiles, the kernels the run's steps launch. ``cache_folder``: where
    a passing verdict is kept between processes (``job.cache_folder``).
    """
    device = torch.device(device)
    if fla_available() and guard_applies(device):
        ensure_backward_checked(padded_head_dim(head_dim, device), device, num_heads=num_heads, dtype=dtype,
                                packed=packed, cache_folder=cache_folder)


# ----------------------------------------------------------------------------------------------------------------
# The adapter: custom ops over fla's stages.


def _chunk_indices(cu_seqlens, given):
    """The chunk indices a caller made once per batch, or (a host synchronisation: fla reads the device tensor
    back) made here from ``cu_seqlens``."""
    if cu_seqlens is None or given is not None:
        return given
    from fla.ops.utils.index import prepare_chunk_indices
    return prepare_chunk_indices(cu_seqlens, CHUNK)


def _state_stages(k, v, g, beta, initial_state, cu_seqlens, chunk_indices, output_final_state):
    """fla's forward up to the state pass (on contiguous inputs, inside the device's context): the in-kernel
    l2norm of k, the gates' chunk cumsum, the intra-chunk WY form and the chunked state recurrence.
    Returns ``(h, v_new, final_state, kn, k_rstd, g_cum, a)``."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    kn, k_rstd = l2norm_fwd(k)
    g_cum = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, a = chunk_gated_delta_rule_fwd_intra(k=kn, v=v, g=g_cum, beta=beta, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices, chunk_size=CHUNK)
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
        k=kn, w=w, u=u, g=g_cum, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK)
    return h, v_new, final_state, kn, k_rstd, g_cum, a


def _gdn_fwd_impl(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state):
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_o import chunk_fwd_o

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    with torch.cuda.device(q.device.index):
        chunk_indices = _chunk_indices(cu_seqlens, chunk_indices)
        qn, q_rstd = l2norm_fwd(q)
        h, v_new, final_state, kn, k_rstd, g_cum, a = _state_stages(k, v, g, beta, initial_state, cu_seqlens,
                                                                    chunk_indices, output_final_state)
        o = chunk_fwd_o(q=qn, k=kn, v=v_new, h=h, g=g_cum, scale=scale, cu_seqlens=cu_seqlens,
                        chunk_indices=chunk_indices, chunk_size=CHUNK)
        del h
        m = torch.linalg.vector_norm(v_new, dim=-1, dtype=torch.float32)
    if final_state is None:
        final_state = q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), m, final_state, qn, q_rstd, kn, k_rstd, g_cum, a


def _gdn_bwd_impl(do, dht, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state, cu_seqlens, chunk_indices,
                  scale, recompute_norms: bool = False):
    """fla's backward; with ``recompute_norms`` ``qn``, ``kn`` hold the raw q, k and the norms are made here."""
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    with torch.cuda.device(do.device.index), fla_backward_allowed(kn.shape[-1], do.device):
        if recompute_norms:
            qn, q_rstd = l2norm_fwd(qn.contiguous())
            kn, k_rstd = l2norm_fwd(kn.contiguous())
        chunk_indices = _chunk_indices(cu_seqlens, chunk_indices)
        if initial_state is None:
            dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
                q=qn, k=kn, v=v, g=g_cum, beta=beta, A=a, scale=scale, initial_state=None, do=do.contiguous(),
                dht=dht, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK)
        else:
            dq, dk, dv, db, dg, dh0 = _bwd_from_initial_state(qn, kn, v, g_cum, beta, a, scale, initial_state,
                                                              do.contiguous(), dht, cu_seqlens, chunk_indices)
        dq = l2norm_bwd(qn, q_rstd, dq)
        dk = l2norm_bwd(kn, k_rstd, dk)
    return dq, dk, dv, dg, db, dh0


def _bwd_from_initial_state(qn, kn, v, g_cum, beta, a, scale, initial_state, do, dht, cu_seqlens, chunk_indices):
    """fla's ``chunk_gated_delta_rule_bwd`` from an incoming state, stage by stage in its order, with the state
    gradient kernel launched without its initial-state output and that gradient formed here instead.

    Why: fla 0.6.0's state-gradient kernel (``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``) compiles with
    96 bytes of stack without the initial-state store and 224 with it (D 256, Triton 3.6, sm_90a,
    ``scripts/kernel_resources.py``), and runs 5.1 ms against 4.0 at 65,536 x 4 x 256 on an H200 (docs/LOG.md,
    2026-12-03): the whole difference between a fresh and a continuing context-parallel shard's state path. The
    kernel's other outputs (the per-chunk state gradients ``dh`` and the corrected ``dv``) do not depend on that
    store, so every other gradient is bitwise fla's own wherever both launches run the same configuration (the
    shipped configurations give them the same one; the autotuner keys them apart); the initial state's gradient is
    the kernel's last update step, made here in float32 by :func:`initial_state_grad` from the first chunk's stored
    ``dh`` (which fla keeps in the compute dtype: one bf16 rounding of the carried gradient that fla's fused store
    does not make; fla's store forms its ``q^T do`` term in TF32, this one in float32). On an H200 the two agree
    within 0.07-0.17% (``tests/test_kernels_triton_gpu.py``).
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    common = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u = recompute_w_u_fwd(k=kn, v=v, beta=beta, A=a, g=g_cum, **common)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kn, w=w, u=u, g=g_cum, initial_state=initial_state,
                                               output_final_state=False, chunk_size=CHUNK, **common)
    dv = chunk_bwd_dv_local(q=qn, k=kn, g=g_cum, do=do, scale=scale, chunk_size=CHUNK, **common)
    dh, _, dv = chunk_gated_delta_rule_bwd_dhu(q=qn, k=kn, w=w, g=g_cum, h0=None, dht=dht, do=do, dv=dv, scale=scale,
                                               chunk_size=CHUNK, **common)
    dh0 = initial_state_grad(dh, qn, w, do, dv, g_cum, scale, cu_seqlens=cu_seqlens, dht=dht)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q=qn, k=kn, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                     chunk_size=CHUNK, **common)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=kn, v=v, beta=beta, g=g_cum, A=a, dw=dw, du=dv, **common)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **common)
    return dq, dk, dv, db, dg, dh0


def initial_state_grad(dh: torch.Tensor, q: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
                       g_cum: torch.Tensor, scale: float, *, cu_seqlens: torch.Tensor | None,
                       dht: torch.Tensor | None) -> torch.Tensor:
    """The gradient of the initial state ``[N, H, K, V]`` (float32) from fla's state-gradient pass run without it.

    fla's pass walks the chunks backward carrying ``dS`` (the gradient of the state after the current chunk) and
    stores it per chunk in ``dh [B, NT, H, K, V]`` before applying the chunk. The initial state's gradient is
    that chunk's update applied to the first chunk of each sequence (``C`` = its rows, at most 64, ``Lc`` its
    last row, ``g`` fla's chunk-local cumulative log2-decay):
        dS0 = 2^g_Lc dh[first] + scale (q_C 2^g_C)^T do_C - w_C^T dv_C
    with ``w`` the WY-form keys and ``dv`` the corrected value gradient of the same pass (``dv2``). ``q`` is the
    l2-normalised query fla ran with. Rows ``[B, T, ...]``; with ``cu_seqlens`` (B = 1) sequence n's first chunk
    is chunk ``sum_{m<n} ceil(T_m / 64)`` of ``dh``. A sequence without tokens passes ``dht`` (or zero) through.
    Device-side indexing only (no host read of ``cu_seqlens``)."""
    f32 = torch.float32
    b, t, h = q.shape[:3]
    if t == 0 or dh.shape[1] == 0:  # no chunk at all: every sequence passes its final-state gradient through
        n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return (dht.to(f32) if dht is not None
                else torch.zeros(n, h, q.shape[-1], do.shape[-1], dtype=f32, device=q.device))
    if cu_seqlens is None:
        c = min(t, CHUNK)
        first, rows, last = dh[:, 0], (lambda x: x[:, :c]), (lambda x: x[:, c - 1])
        mask = None
        empty = None
    else:
        from fla.ops.utils.index import prepare_chunk_offsets

        bos, lens = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        # fla's own chunk offsets, the ones its state-gradient kernel indexed dh with (cached by fla on this
        # cu_seqlens tensor, so not made again after that kernel's launch).
        first_chunk = prepare_chunk_offsets(cu_seqlens, CHUNK)[:-1].clamp_max(dh.shape[1] - 1)
        first = dh[0, first_chunk]                                                  # [N, H, K, V]
        offs = torch.arange(CHUNK, device=q.device)
        mask = offs[None, :] < lens[:, None]                                        # [N, C]
        last_row = (lens.clamp_max(CHUNK) - 1).clamp_min(0)                        # of the first chunk
        index = (bos[:, None] + offs[None, :].minimum(last_row[:, None])).clamp(0, t - 1)
        end = (bos + last_row).clamp(0, t - 1)
        rows, last = (lambda x: x[0, index]), (lambda x: x[0, end])                 # [N, C, ...], [N, ...]
        empty = lens == 0
    g_c = rows(g_cum).to(f32)                                                       # [N, C, H]
    qg = rows(q).to(f32) * torch.exp2(g_c)[..., None]
    w_c, do_c, dv_c = rows(w).to(f32), rows(do).to(f32), rows(dv).to(f32)
    if mask is not None:
        m = mask[:, :, None, None].to(f32)
        qg, w_c = qg * m, w_c * m
    dS0 = (torch.exp2(last(g_cum).to(f32))[..., None, None] * first.to(f32)
           + scale * torch.einsum("nchk,nchv->nhkv", qg, do_c) - torch.einsum("nchk,nchv->nhkv", w_c, dv_c))
    if empty is not None:
        through = dht.to(f32) if dht is not None else torch.zeros_like(dS0)
        dS0 = torch.where(empty[:, None, None, None], through, dS0)
    return dS0


@torch.library.custom_op("hola::gdn_fwd", mutates_args=())
def gdn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
               chunk_indices: torch.Tensor | None, scale: float, output_final_state: bool,
               recompute_norms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """``(o, m, final_state or empty, saved for backward...)``; see the module docstring. With
    ``recompute_norms`` the four normalisation outputs are empty (the backward remakes them from q and k)."""
    out = _gdn_fwd_impl(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state)
    if recompute_norms:
        empty = q.new_empty(0, dtype=torch.float32)
        return (*out[:3], q.new_empty(0), empty, k.new_empty(0), empty.clone(), *out[7:])
    return out


@gdn_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state, recompute_norms):
    b, t, h, d = q.shape
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = torch.float32
    final = q.new_empty(n, h, d, d, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    if recompute_norms:
        norms = (q.new_empty(0), q.new_empty(0, dtype=f32), k.new_empty(0), k.new_empty(0, dtype=f32))
    else:
        norms = (torch.empty_like(q), q.new_empty(b, t, h, dtype=f32), torch.empty_like(k),
                 k.new_empty(b, t, h, dtype=f32))
    return (torch.empty_like(q), q.new_empty(b, t, h, dtype=f32), final, *norms, g.new_empty(b, t, h, dtype=f32),
            k.new_empty(b, t, h, CHUNK))


@torch.library.custom_op("hola::gdn_bwd", mutates_args=())
def gdn_bwd_op(do: torch.Tensor, dht: torch.Tensor | None, qn: torch.Tensor, q_rstd: torch.Tensor, kn: torch.Tensor,
               k_rstd: torch.Tensor, v: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
               initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
               chunk_indices: torch.Tensor | None, scale: float,
               recompute_norms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """fla's backward; with ``recompute_norms``, ``qn`` and ``kn`` are the raw q and k (rstd arguments empty)."""
    dq, dk, dv, dg, db, dh0 = _gdn_bwd_impl(do, dht, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state,
                                            cu_seqlens, chunk_indices, scale, recompute_norms)
    if dh0 is None:
        dh0 = do.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dg, db, dh0


@gdn_bwd_op.register_fake
def _(do, dht, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state, cu_seqlens, chunk_indices, scale,
      recompute_norms):
    dh0 = (torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None
           else do.new_empty(0, dtype=torch.float32))
    return (torch.empty_like(qn), torch.empty_like(kn), torch.empty_like(v), torch.empty_like(g_cum),
            torch.empty_like(beta), dh0)  # fla's dbeta has beta's dtype


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state, recompute_norms = inputs
    _, _, _, qn, q_rstd, kn, k_rstd, g_cum, a = output
    if recompute_norms:  # the raw q and k, which the caller keeps for its own backward too: one copy for both
        qn, kn = q, k
    ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state, cu_seqlens, chunk_indices)
    ctx.scale = scale
    ctx.recompute_norms = recompute_norms
    ctx.output_final_state = output_final_state
    ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the score and the saved outputs


def _gdn_backward(ctx, do, dm, dht, *unused):
    qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state, cu_seqlens, chunk_indices = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = torch.zeros_like(qn)
    if not ctx.output_final_state or dht is None or dht.numel() == 0:
        dht = None
    # The forward ran fla on contiguous copies of v and beta; the saved inputs are the originals.
    dq, dk, dv, dg, db, dh0 = gdn_bwd_op(do, dht, qn, q_rstd, kn, k_rstd, v.contiguous(), g_cum, beta.contiguous(), a,
                                         initial_state, cu_seqlens, chunk_indices, ctx.scale, ctx.recompute_norms)
    tq, tk, tv, tg, tb = ctx.dtypes
    return (dq.to(tq), dk.to(tk), dv.to(tv), dg.to(tg), db.to(tb), dh0 if initial_state is not None else None,
            None, None, None, None, None)


torch.library.register_autograd("hola::gdn_fwd", _gdn_backward, setup_context=_gdn_setup_context)


class _GDNFunction:
    """Calls the custom op; kept as a tiny namespace so the #640 check and the adapter share one entry."""

    @staticmethod
    def apply(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale, output_final_state,
              recompute_norms=False):
        o, m, final_state, *_ = gdn_fwd_op(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, scale,
                                           output_final_state, recompute_norms)
        return o, m, (final_state if output_final_state else None)


def gdn_with_scores(q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, chunk_indices=None,
                    output_final_state=False, recompute_norms: bool = False, scale: float | None = None):
    """GDN state path through fla with the score: ``(o_state [B,T,H,D], m [B,T,H] float32, final_state or None)``.

    ``q, k`` are pre-l2norm (fla normalises them in its kernel); ``g`` is the log-decay, ``beta`` in (0, 1).
    ``chunk_indices``: fla's chunk indices of ``cu_seqlens`` made once per batch from the host copy
    (``Documents.chunk_indices``, :func:`~hola_titan.kernels.runtime.documents.chunk_indices_from_host`); None makes
    them here, from the device tensor. ``recompute_norms``: keep the raw q and k for backward, not their normalised
    copies (see the module docstring); only where they are kept unpadded (a padded head dim makes copies, so it would
    add a pass and save nothing). ``scale``: the state read's factor, fla's ``scale`` (None: ``D^-1/2`` of the unpadded
    head dim).
    """
    if not torch.compiler.is_compiling():
        _require_fla()
    d = q.shape[-1]
    dp = padded_head_dim(d, q.device)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int64)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)
    if dp != d:
        q, k, v = (F.pad(x, (0, dp - d)) for x in (q, k, v))
        if initial_state is not None:
            initial_state = F.pad(initial_state, (0, dp - d, 0, dp - d))
    if (not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k, v, g, beta))):
        ensure_backward_checked(dp, q.device, num_heads=q.shape[2], dtype=q.dtype, packed=cu_seqlens is not None)
    o, m, final_state = _GDNFunction.apply(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices,
                                           d ** -0.5 if scale is None else scale, output_final_state,
                                           recompute_norms and dp == d)
    if dp != d:
        o = o[..., :d]
        if final_state is not None:
            final_state = final_state[..., :d, :d]
    return o, m, final_state
