"""Triton cache attention of HOLA: forward and backward of the read over [P_b | causal block | sink].

Shape legend: B batch, T tokens, H heads, D head dim, NB blocks, W window, C block, E = NB * H * W cache slots.
Token tensors are ``[B, T, H, D]`` contiguous and addressed as rows ``[B * T * H, D]`` (row = token * H + head);
blocks and selections follow :mod:`hola_titan.kernels.hola.selection`.

Math per query t of block b, head h (``s = D^-1/2``; ``r_x = rsqrt(mean(x^2) + eps)``):
    qc = q r_q gamma_q,  kc = k r_k gamma_k,  logit_tj = s qc_t . kc_j,  j in P_b u {b*C <= j <= t}
    o_cache_t = sum_j softmax_j(logits, sink_h) v_j,   o_t = o_state_t + sigmoid(gate_h) o_cache_t
The RMSNorms are fused: r_q and r_k are computed once per token (a [B*T, H] float32 pass), and
``logit_tj = (q_t r_q_t gamma_q gamma_k s) . k_j  r_k_j``, so key tiles are read raw and never normalised inside
the loops (the query side carries both gammas). The softmax runs in float32 base 2 from the sink
(``m = sink, l = 1``), and saves the log-sum-exp per query.

Backward (FlashAttention-2 style, without the cache output): ``delta_t = lambda <do_t, o_cache_t>``, which the
softmax backward needs per query, is not read from a saved ``o_cache`` (one more [B, T, H, D] tensor kept per layer
for backward) but formed by the dq program of the query tile in the same pass as dq: with ``dp_tj = lambda <do_t,
v_j>`` and ``delta_t = sum_j p_tj dp_tj``, ``dq_t = sum_j p_tj (dp_tj - delta_t) kc_j = sum_j p_tj dp_tj kc_j -
delta_t sum_j p_tj kc_j``, so the program accumulates both sums and ``delta`` and combines them at the end (one
more product per key tile). It writes ``delta`` for the dk/dv programs, which run after it, and the per-program
partial sums of the sink and gate gradients. One program per key tile (a cache tile of block b, or an in-block
tile) accumulates dk and dv over the queries that read it. In-block keys belong to one block, so their rows are
written directly; cache rows are read by many blocks, so each block writes its partial [W, D] rows and a
deterministic segmented reduction (stable sort by destination row, fixed order) adds them. The RMSNorm backward is
linear in the incoming gradient, so every program applies it to its own partial. gamma, sink and gate gradients
are per-program partial sums reduced by torch in a fixed order: the whole backward is deterministic, except
under DQ_ATOMIC (see ``VARIANTS``), whose dq sums are atomic adds in no fixed order: the launch that a kept
forward output takes at head dim 256 (``CONFIGS["dkdv_kept"]``) when these kernels run it, unless torch's
deterministic algorithms are on. On an sm_90 GPU at head dim 256 a fresh call's forward and backward run instead on
the Gluon kernels of :mod:`hola_titan.kernels.hola.gluon_kernels` (same function, same partial sums, no atomic adds;
``FORWARD``, ``BACKWARD``).

Two sources of keys (a call that continues from a cache, :class:`Prefix`): besides the token rows, a small tensor
of prefix rows (the cache's entries and its unfinished block's buffered tokens) that are keys, never queries. A
block may start with prefix rows (the unfinished block, completed by new tokens: its key positions are the prefix
rows, then its tokens, and query i sits at position ``pre + i``), and a cache slot names a token row or, as
``-2 - a``, prefix row ``a``. The ``*_pre_kernel`` variants take the prefix (a ``HAS_PRE`` constexpr in the shared
bodies); the kernels of a fresh call keep their signatures and compile without a trace of it. The prefix's
gradient rows take the same reductions: in-block rows are written by their block, cache reads add to them in the
reduction (keys from ``A_BASE`` on name prefix rows).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

logger = logging.getLogger(__name__)

NORM_EPS = 1e-6
LOG2E = 1.4426950408889634

# Launch configurations (block sizes, warps, stages) per head dim for the GPU; the interpreter uses 16 x 16 tiles.
# One fixed configuration per kernel instead of autotune: autotuned launches fail in the interpreter, and a fresh
# machine would re-tune every run. scripts/bench_hola_attention.py sweeps alternatives.
# BM: query tile, BN: key tile. D = 128 picked by the fewest register spills in ptxas (Triton 3.6); D = 256 by
# timing on an H200 (scripts/bench_hola_attention.py --sweep, 65,536 tokens, 4 heads; the numbers are in
# docs/LOG.md), against the ptxas pick (64 x 32, 8 warps).
CONFIGS = {
    "fwd": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
            256: dict(BM=64, BN=32, num_warps=4, num_stages=2)},
    "dq": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
           256: dict(BM=32, BN=32, num_warps=4, num_stages=2)},
    "dkdv": {64: dict(BM=64, BN=64, num_warps=4, num_stages=3), 128: dict(BM=64, BN=32, num_warps=8, num_stages=2),
             256: dict(BM=32, BN=32, num_warps=4, num_stages=2)},
}
# The dk/dv launch when the forward kept its output (``save_output``): at D 256 DQ_ATOMIC, which is then 5
# products per pair and was 11% faster over the whole cache backward on an H200 (1.88 ms against 2.12 without the
# kept output and 2.02 with it; without the kept output DQ_ATOMIC's delta pass made it slower, 2.34 ms; LOG
# 2026-12-03). D 64 and 128 keep the plain table's launch (not timed with the kept output).
CONFIGS["dkdv_kept"] = {**{d: dict(cfg) for d, cfg in CONFIGS["dkdv"].items()},
                        256: dict(CONFIGS["dkdv"][256], DQ_ATOMIC=True)}
# float32 inputs (the MQAR recipes, exact checks): ``input_precision="ieee"`` products run on the FMA units, not
# the tensor cores, and with the tables above their tiles spilled: at head dim 64 the 64 x 64 launches kept 2-15 KB
# a thread on the stack and took 7.5-20.9 s each to compile (ptxas, Triton 3.6, sm_90a; the dq kernel alone was the
# MQAR start-up's longest wait, 20.1 s on a fresh H100). 32 x 32 tiles with 8 warps spill 0-48 bytes at head dims
# 64 and 128 (424 in the forward at 128) and compile in 1.6-4.5 s (scripts/kernel_resources.py; docs/LOG.md,
# 2026-12-06). Head dims not listed take the table above.
CONFIGS_FLOAT32 = {kind: {d: dict(BM=32, BN=32, num_warps=8, num_stages=2) for d in (64, 128)}
                   for kind in ("fwd", "dq", "dkdv", "dkdv_kept")}
_INTERPRET_CONFIG = dict(BM=16, BN=16, num_warps=1, num_stages=1)

# Tests set this to fill every output buffer with NaN before the kernels run, so unwritten elements fail.
POISON_OUTPUTS = False


def _empty(*shape, dtype, device):
    if POISON_OUTPUTS:  # NaN, or for indices the most negative value: no valid row
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, poison, dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


# Kernel variants a launch configuration may choose (scripts/bench_hola_attention.py --sweep times them): the
# forward with its output columns split over SPLIT programs, the dq pass in two passes over the keys, dk and dv
# summed by separate launches (SEPARATE), and DQ_ATOMIC: dq summed by the dk/dv programs (atomic float32 adds,
# FlashAttention-2's order), after a pass that forms only ``delta`` (two products per pair) and before a
# per-row epilogue, so 7 products per pair instead of 8 (the dq config's tiles serve the delta pass and the
# epilogue); 5 when the forward kept its output (``save_output``), whose row sums give delta without a pass.
# Atomic adds sum dq in no fixed order: under torch.use_deterministic_algorithms (the trainer's
# ``training.deterministic``) DQ_ATOMIC is not used. Fresh calls only: a call continuing from a cache runs the
# plain kernels (with the same tiles) whatever the variant.
VARIANTS = {"fwd": ("SPLIT",), "dq": ("TWO_PASS",), "dkdv": ("SEPARATE", "DQ_ATOMIC")}
VARIANTS["dkdv_kept"] = VARIANTS["dkdv"]


# Which kernels run a fresh call's forward and backward, per head dim, on a GPU that has Hopper's warpgroup MMA
# (sm_90): "gluon" (:mod:`hola_titan.kernels.hola.gluon_kernels`, 64-row warpgroup-MMA tiles) or "triton" (the kernels
# here, with the CONFIGS launches). Timed on an H200 at D 256 (docs/LOG.md, 2026-12-03). Elsewhere
# (other head dims and GPUs, float32, Triton's interpreter, a call continuing from a cache) the Triton kernels run;
# :func:`forward_kernels` and :func:`backward_kernels` say which and why, and a run's ``paths`` lines report it.
DEFAULT_FORWARD = {256: "gluon"}
DEFAULT_BACKWARD = {256: "gluon"}
FORWARD = dict(DEFAULT_FORWARD)
BACKWARD = dict(DEFAULT_BACKWARD)
# model.cache_kernels as the trainer last set it (set_cache_kernels): the reason a Triton choice gives.
_CACHE_KERNELS = {"choice": "auto"}
GLUON_WHY = "warpgroup-MMA tiles on sm_90"


def set_cache_kernels(choice: str) -> None:
    """``model.cache_kernels`` for this process: ``auto`` restores the launch tables' defaults (dropping whatever a
    caller had set in them), ``triton`` empties them (every head dim on the Triton kernels). Every trainer sets it
    from its config before its first launch, so that one run's choice does not carry over to the next."""
    if choice not in ("auto", "triton"):
        raise ValueError(f"cache_kernels: expected 'auto' or 'triton', got {choice!r}")
    for table, default in ((FORWARD, DEFAULT_FORWARD), (BACKWARD, DEFAULT_BACKWARD)):
        table.clear()
        if choice == "auto":
            table.update(default)
    _CACHE_KERNELS["choice"] = choice


def forward_kernels(d: int, dtype: torch.dtype | None, device: torch.device, *,
                    continuing: bool = False) -> tuple[str, str]:
    """("gluon" or "triton", why) for a cache-read forward at head dim ``d`` in ``dtype`` (the inputs' common dtype,
    None when they differ) on ``device``."""
    return _kernels_choice(FORWARD, d, dtype, device, continuing)


def backward_kernels(d: int, dtype: torch.dtype | None, device: torch.device, *,
                     continuing: bool = False) -> tuple[str, str]:
    """("gluon" or "triton", why) for a cache-read backward at head dim ``d`` in ``dtype`` (the inputs' common
    dtype, None when they differ) on ``device``."""
    return _kernels_choice(BACKWARD, d, dtype, device, continuing)


def _launch_choice(table: dict, direction: str, d: int, dtype: torch.dtype | None, device: torch.device,
                   continuing: bool) -> str:
    """The kernels a launch takes. Where the table names the Gluon kernels on a GPU but a fresh call takes the
    Triton ones (a reason the run's paths lines, made from the run's settings, may not have foreseen: inputs in
    another dtype, say), the log says so, once per reason."""
    kernels, why = _kernels_choice(table, d, dtype, device, continuing)
    if kernels == "triton" and table.get(d) == "gluon" and device.type == "cuda" and not continuing:
        _log_fallback(direction, why)
    return kernels


@functools.lru_cache(maxsize=None)
def _log_fallback(direction: str, why: str) -> None:
    logger.warning("cache-read %s: the Triton kernels run, not the Gluon ones: %s", direction, why)


def _kernels_choice(table: dict, d: int, dtype: torch.dtype | None, device: torch.device, continuing: bool):
    """``dtype``: the inputs' common dtype, None when they differ."""
    if table.get(d, "triton") != "gluon":
        default = DEFAULT_FORWARD if table is FORWARD else DEFAULT_BACKWARD if table is BACKWARD else {}
        if _CACHE_KERNELS["choice"] == "triton" and default.get(d) == "gluon":
            return "triton", "model.cache_kernels = triton"
        return "triton", f"the launch table names Triton at head dim {d}"
    if device.type != "cuda":
        return "triton", "Gluon kernels need a GPU (Triton's interpreter runs the Triton kernels)"
    if torch.version.hip is not None:
        return "triton", "the Gluon kernels are written for NVIDIA's sm_90 (this is a ROCm build)"
    if torch.cuda.get_device_capability(device)[0] != 9:
        major, minor = torch.cuda.get_device_capability(device)
        return "triton", f"the Gluon kernels use sm_90's warpgroup MMA; this GPU is sm_{major}{minor}"
    try:
        from hola_titan.kernels.hola import gluon_kernels
    except Exception as exc:  # noqa: BLE001 - an experimental API that moved: the Triton kernels, and the reason
        return "triton", f"the Gluon kernels do not load with this Triton ({type(exc).__name__}: {exc})"
    if gluon_kernels.GLUON_MISSING:
        return "triton", f"this Triton has no Gluon ({gluon_kernels.GLUON_MISSING})"
    version = ".".join(triton.__version__.split(".")[:2])
    if version not in gluon_kernels.TRITON_VERSIONS:
        return "triton", (f"the Gluon kernels are written for Triton {', '.join(gluon_kernels.TRITON_VERSIONS)}; "
                          f"this is {triton.__version__}")
    if d not in gluon_kernels.HEAD_DIMS:
        return "triton", f"the Gluon kernels are written for head dims {gluon_kernels.HEAD_DIMS}, not {d}"
    if dtype is None:
        return "triton", "q, k and v (and the output gradient) come in different dtypes"
    if str(dtype).removeprefix("torch.") not in gluon_kernels.DTYPES:
        return "triton", f"the Gluon kernels take bf16/fp16 inputs, not {dtype}"
    if continuing:
        return "triton", "a call continuing from a cache (prefix rows) runs the Triton kernels"
    return "gluon", f"{GLUON_WHY} (gluon_kernels.py)"


def kept_output_sums_dq_atomically(d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a backward with the forward's kept output sums dq by atomic adds (DQ_ATOMIC) at head dim ``d`` and
    ``dtype`` on ``device``, when torch's deterministic algorithms are off and the Triton kernels run it: what a
    run's ``paths`` line reports."""
    return bool(_config("dkdv_kept", d, dtype, device).get("DQ_ATOMIC", False))


def _kernels_label(kernels: str, why: str) -> str:
    """The start of a ``paths`` line for a choice of :func:`forward_kernels` / :func:`backward_kernels`."""
    return f"Gluon kernels (gluon_kernels.py: {GLUON_WHY})" if kernels == "gluon" else f"Triton kernels ({why})"


def describe_cache_forward(d: int, dtype: torch.dtype, device: torch.device) -> str:
    """A run's ``paths.cache_forward`` line: the kernels of a fresh call's cache-read forward."""
    return _kernels_label(*forward_kernels(d, dtype, device))


def describe_cache_backward(d: int, dtype: torch.dtype, device: torch.device, *, kept_output: bool,
                            deterministic: bool) -> str:
    """A run's ``paths.cache_backward`` line: the kernels of a fresh call's cache-read backward and where its
    ``delta`` comes from."""
    kernels, why = backward_kernels(d, dtype, device)
    text = _kernels_label(kernels, why)
    if kernels == "triton" and kept_output and kept_output_sums_dq_atomically(d, dtype, device) and not deterministic:
        text += "; dq summed by the dk/dv programs with atomic adds, in no fixed order"
    return text + ("; delta from the kept cache-read output (model.save_cache_output)" if kept_output else
                   "; delta over the cache's keys (output not kept)")


def _config(kind: str, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The launch of ``kind`` at head dim ``d`` for inputs of ``dtype``: ``CONFIGS_FLOAT32`` for float32 where it
    lists ``d``, else ``CONFIGS`` (its nearest head dim where it does not list ``d``)."""
    if device.type != "cuda":  # Triton's interpreter
        cfg = dict(_INTERPRET_CONFIG)
    elif dtype == torch.float32 and d in CONFIGS_FLOAT32[kind]:
        cfg = dict(CONFIGS_FLOAT32[kind][d])
    else:
        table = CONFIGS[kind]
        cfg = dict(table[min(table, key=lambda x: abs(x - d))]) if d not in table else dict(table[d])
    known = ("BM", "BN", "num_warps", "num_stages", *VARIANTS[kind])
    return {key: value for key, value in cfg.items() if key in known}


if triton is not None:

    @triton.jit(do_not_specialize=["R"])
    def _rstd_kernel(x_ptr, r_ptr, R, EPS, D: tl.constexpr, BR: tl.constexpr):
        o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        mask = o_r < R
        b_x = tl.load(x_ptr + o_r[:, None] * D + tl.arange(0, D)[None, :], mask=mask[:, None], other=0.0)
        b_x = b_x.to(tl.float32)
        tl.store(r_ptr + o_r, tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + EPS), mask=mask)

    @triton.jit
    def _load_rows(x_ptr, y_ptr, r_ptr, row, ok, D: tl.constexpr, DV: tl.constexpr, y_off):
        """Rows ``row`` (flat row = token * H + head) of x, columns ``y_off ... y_off + DV`` of y, and x's rstd,
        zeros where not ``ok``: masked loads, not rows read and then given zero weight (0 x NaN would carry one
        packed document's non-finite values into another's results)."""
        o_d = tl.arange(0, D)
        b_x = tl.load(x_ptr + row[:, None] * D + o_d[None, :], mask=ok[:, None], other=0.0)
        b_y = tl.load(y_ptr + row[:, None] * D + y_off + tl.arange(0, DV)[None, :], mask=ok[:, None], other=0.0)
        return b_x, b_y, tl.load(r_ptr + row, mask=ok, other=0.0)

    @triton.jit
    def _both(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a, a_ok, D: tl.constexpr,
              HAS_PRE: tl.constexpr, DV: tl.constexpr, v_off):
        """k, v (columns ``v_off ... v_off + DV``), rstd of key rows from the token rows (``t_ok``) or, with a
        prefix, the prefix rows (``a_ok``): two masked reads and a select (the dk/dv kernels' form, see
        :func:`_load_two`)."""
        b_k, b_v, b_rk = _load_rows(k_ptr, v_ptr, rk_ptr, row, t_ok, D, DV, v_off)
        if HAS_PRE:
            b_ka, b_va, b_rka = _load_rows(ka_ptr, va_ptr, rka_ptr, row_a, a_ok, D, DV, v_off)
            b_k = tl.where(a_ok[:, None], b_ka, b_k)
            b_v = tl.where(a_ok[:, None], b_va, b_v)
            b_rk = tl.where(a_ok, b_rka, b_rk)
        return b_k, b_v, b_rk

    @triton.jit
    def _two(x_ptr, xa_ptr, row, row_a, a_ok, WIDTH: tl.constexpr):
        """Per-row pointers: the start of row ``row`` of x, or of row ``row_a`` of xa where ``a_ok``."""
        return tl.where(a_ok, xa_ptr + row_a * WIDTH, x_ptr + row * WIDTH)

    @triton.jit
    def _load_two(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a, a_ok, D: tl.constexpr,
                  HAS_PRE: tl.constexpr, DV: tl.constexpr, v_off):
        """As :func:`_both`, with a prefix as one read through per-row pointers into either source: the forward
        and dq kernels read a key tile every step of their loops, and the two tiles of :func:`_both` spill there
        (D 256, 64x32 / 32x32 tiles, Triton 3.6, sm_90a: forward 272 bytes of stack against 32 this way, dq 440
        against 144; the dk/dv kernel, which reads its key tile once, compiles to 192 with :func:`_both` and 264
        this way, so it keeps that form)."""
        if HAS_PRE:
            ok = t_ok | a_ok
            b_k = tl.load(_two(k_ptr, ka_ptr, row, row_a, a_ok, D)[:, None] + tl.arange(0, D)[None, :],
                          mask=ok[:, None], other=0.0)
            b_v = tl.load(_two(v_ptr, va_ptr, row, row_a, a_ok, D)[:, None] + v_off + tl.arange(0, DV)[None, :],
                          mask=ok[:, None], other=0.0)
            return b_k, b_v, tl.load(_two(rk_ptr, rka_ptr, row, row_a, a_ok, 1), mask=ok, other=0.0)
        else:
            return _load_rows(k_ptr, v_ptr, rk_ptr, row, t_ok, D, DV, v_off)

    @triton.jit
    def _cache_rows(sel_ptr, i_b, i_h, c0, H, W, BN: tl.constexpr, HAS_PRE: tl.constexpr):
        """Slots c0 ... c0 + BN of block i_b's cache: slot numbers, token rows (``t_ok``) and prefix rows
        (``a_ok``: with a prefix, selection entries ``-2 - a`` name prefix row ``a``; every negative entry is an
        empty slot without one)."""
        o_n = c0 + tl.arange(0, BN)
        b_idx = tl.load(sel_ptr + (i_b * H + i_h) * W + o_n, mask=o_n < W, other=-1).to(tl.int64)
        t_ok = b_idx >= 0
        if HAS_PRE:
            a_ok = b_idx <= -2
        else:  # a constant: what it masks folds away
            a_ok = tl.full([BN], 0, tl.int1)
        return o_n, t_ok, tl.where(t_ok, b_idx, 0) * H + i_h, a_ok, tl.where(a_ok, -2 - b_idx, 0) * H + i_h

    @triton.jit
    def _block_rows(start, length, pre_start, pre, c0, H, i_h, BN: tl.constexpr, HAS_PRE: tl.constexpr):
        """Keys at positions c0 ... c0 + BN of a block: its ``pre`` prefix rows first (from ``pre_start``), then
        its ``length`` token rows (from ``start``)."""
        o_n = c0 + tl.arange(0, BN)
        if HAS_PRE:
            a_ok = o_n < pre
            t_ok = (o_n >= pre) & (o_n < pre + length)
            row = (start + tl.where(t_ok, o_n - pre, 0)) * H + i_h
            row_a = (pre_start + tl.where(a_ok, o_n, 0)) * H + i_h
        else:
            a_ok = tl.full([BN], 0, tl.int1)
            t_ok = o_n < length
            row = (start + o_n) * H + i_h
            row_a = row
        return o_n, t_ok, row, a_ok, row_a

    @triton.jit
    def _prefix(pre_start_ptr, pre_len_ptr, i_b, HAS_PRE: tl.constexpr):
        """(first prefix row, prefix rows) of block i_b; (0, 0) without a prefix."""
        if HAS_PRE:
            return tl.load(pre_start_ptr + i_b).to(tl.int64), tl.load(pre_len_ptr + i_b)
        else:
            return 0, 0

    @triton.jit
    def _query_block(blk_start_ptr, blk_len_ptr, NQT, BM: tl.constexpr, SPLIT: tl.constexpr):
        """This program's query tile: (pid, head, block, first query in the block, block start row, length); with
        ``SPLIT`` programs per head (axis 1 = head * SPLIT + part)."""
        pid = tl.program_id(0)
        i_h = (tl.program_id(1) // SPLIT).to(tl.int64)
        i_b = (pid // NQT).to(tl.int64)
        q0 = (pid % NQT) * BM
        return pid, i_h, i_b, q0, tl.load(blk_start_ptr + i_b).to(tl.int64), tl.load(blk_len_ptr + i_b)

    @triton.jit
    def _query_tile(q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start, length, q0, H, scale,
                    D: tl.constexpr, BM: tl.constexpr):
        """Queries q0 ... q0 + BM of a block: positions, mask, flat rows and offsets, q, its rstd, both gammas, and
        the scaled normalised query ``q r gamma_q gamma_k scale log2(e)`` (in q's dtype) that the tiles dot with
        the raw keys (their rstd applied after the dot)."""
        o_m = q0 + tl.arange(0, BM)
        m_ok = o_m < length
        o_d = tl.arange(0, D)
        row_q = (start + o_m) * H + i_h
        p_q = row_q[:, None] * D + o_d[None, :]
        b_q = tl.load(q_ptr + p_q, mask=m_ok[:, None], other=0.0)
        b_rq = tl.load(rq_ptr + row_q, mask=m_ok, other=0.0)
        b_gq = tl.load(gq_ptr + o_d).to(tl.float32)
        b_gk = tl.load(gk_ptr + o_d).to(tl.float32)
        b_qs = (b_q.to(tl.float32) * b_rq[:, None] * (b_gq * b_gk)[None, :] * (scale * 1.4426950408889634))
        return o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs.to(b_q.dtype)

    @triton.jit
    def _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, b_ok, DOT_PREC: tl.constexpr):
        b_s = tl.dot(b_qs, tl.trans(b_k), input_precision=DOT_PREC) * b_rk[None, :]
        b_s = tl.where(b_ok, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        return b_m_new, b_l, b_acc

    @triton.jit
    def _prefix_tiles_end(pre, hi, BN: tl.constexpr, HAS_PRE: tl.constexpr):
        """The end of a block's key tiles that hold prefix rows (positions ``0 ... pre - 1`` come first), at most
        ``hi``; 0 without a prefix. Tiles from there on hold token rows only."""
        if HAS_PRE:
            return tl.minimum(tl.cdiv(pre, BN) * BN, hi)
        else:
            return 0

    @triton.jit
    def _own_rows(start, length, pre_start, pre, c0, H, i_h, BN: tl.constexpr, TWO: tl.constexpr):
        """:func:`_block_rows` for a tile of the block's own keys: with ``TWO`` a tile that may hold prefix rows
        (both sources); else one past the prefix, addressed as token rows alone (the single read of a fresh call:
        a continuing call's every tile read through per-row source selection cost its forward ~28% at 64k, H200)."""
        if TWO:
            return _block_rows(start, length, pre_start, pre, c0, H, i_h, BN, True)
        else:  # positions c0 ... >= pre: token row start + position - pre
            return _block_rows(start - pre, length + pre, pre_start, 0, c0, H, i_h, BN, False)

    @triton.jit
    def _fwd_block_loop(lo, hi, b_qs, b_m, b_l, b_acc, o_m, start, length, pre_start, pre, k_ptr, v_ptr, rk_ptr,
                        ka_ptr, va_ptr, rka_ptr, H, i_h, v_off, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
                        DOT_PREC: tl.constexpr, TWO: tl.constexpr):
        """The forward over the block's own key tiles at positions ``lo ... hi`` (``TWO`` as in :func:`_own_rows`),
        causal: query i sits at position pre + i."""
        for c0 in range(lo, hi, BN):
            o_n, t_ok, row, a_ok, row_a = _own_rows(start, length, pre_start, pre, c0, H, i_h, BN, TWO)
            b_k, b_v, b_rk = _load_two(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a, a_ok, D, TWO,
                                       DV, v_off)
            b_ok = (t_ok | a_ok)[None, :] & (o_n[None, :] <= o_m[:, None] + pre)
            b_m, b_l, b_acc = _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, b_ok, DOT_PREC)
        return b_m, b_l, b_acc

    @triton.jit
    def _cache_fwd_core(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                        gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, ka_ptr, va_ptr, rka_ptr, pre_start_ptr,
                        pre_len_ptr, oc_ptr, H, NQT, scale, W, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        DOT_PREC: tl.constexpr, HAS_PRE: tl.constexpr, SPLIT: tl.constexpr, STORE_OC: tl.constexpr):
        """``SPLIT`` > 1: each of SPLIT programs of a query tile computes the whole softmax (q k^T over all D) but
        accumulates and writes only its D / SPLIT output columns (a smaller accumulator, for fewer registers).
        ``STORE_OC``: also write the cache read's own output ``o_cache`` to ``oc`` (kept for the backward)."""
        pid, i_h, i_b, q0, start, length = _query_block(blk_start_ptr, blk_len_ptr, NQT, BM, SPLIT)
        part = tl.program_id(1) % SPLIT
        v_off = part * (D // SPLIT)
        if q0 < length:
            pre_start, pre = _prefix(pre_start_ptr, pre_len_ptr, i_b, HAS_PRE)
            o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs = _query_tile(
                q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start, length, q0, H, scale, D, BM)
            b_sink = tl.load(sink_ptr + i_h).to(tl.float32) * 1.4426950408889634
            b_m = tl.zeros([BM], dtype=tl.float32) + b_sink
            b_l = tl.full([BM], 1.0, dtype=tl.float32)
            b_acc = tl.zeros([BM, D // SPLIT], dtype=tl.float32)
            if W > 0:
                for c0 in range(0, W, BN):
                    o_n, t_ok, row, a_ok, row_a = _cache_rows(sel_ptr, i_b, i_h, c0, H, W, BN, HAS_PRE)
                    b_k, b_v, b_rk = _load_two(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a,
                                               a_ok, D, HAS_PRE, D // SPLIT, v_off)
                    b_m, b_l, b_acc = _fwd_tile(b_qs, b_m, b_l, b_acc, b_k, b_v, b_rk, (t_ok | a_ok)[None, :],
                                                DOT_PREC)
            # Key positions up to the tile's last query, whose position in the block is pre + its index.
            hi = tl.minimum(q0 + BM, length) + pre
            mid = _prefix_tiles_end(pre, hi, BN, HAS_PRE)
            if HAS_PRE:
                b_m, b_l, b_acc = _fwd_block_loop(0, mid, b_qs, b_m, b_l, b_acc, o_m, start, length, pre_start, pre,
                                                  k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, H, i_h, v_off, D,
                                                  D // SPLIT, BN, DOT_PREC, True)
            b_m, b_l, b_acc = _fwd_block_loop(mid, hi, b_qs, b_m, b_l, b_acc, o_m, start, length, pre_start, pre,
                                              k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, H, i_h, v_off, D,
                                              D // SPLIT, BN, DOT_PREC, False)
            b_oc = b_acc / b_l[:, None]
            if SPLIT == 1:
                tl.store(lse_ptr + row_q, b_m + tl.log2(b_l), mask=m_ok)
            elif part == 0:  # every part has the same log-sum-exp: the first writes it
                tl.store(lse_ptr + row_q, b_m + tl.log2(b_l), mask=m_ok)
            b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
            if SPLIT == 1:
                p_o = p_q
            else:
                p_o = row_q[:, None] * D + v_off + tl.arange(0, D // SPLIT)[None, :]
            b_os = tl.load(os_ptr + p_o, mask=m_ok[:, None], other=0.0).to(tl.float32)
            tl.store(o_ptr + p_o, (b_os + b_lam * b_oc).to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
            if STORE_OC:
                tl.store(oc_ptr + p_o, b_oc.to(oc_ptr.dtype.element_ty), mask=m_ok[:, None])

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_fwd_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                          sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, H, NQT, scale, W,
                          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          DOT_PREC: tl.constexpr):
        _cache_fwd_core(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                        gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr,
                        blk_len_ptr, o_ptr, H, NQT, scale, W, D, BM, BN, DOT_PREC, False, 1, False)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_fwd_oc_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, oc_ptr, H, NQT, scale, W,
                             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             DOT_PREC: tl.constexpr, SPLIT: tl.constexpr):
        """The fresh call's forward that also writes ``o_cache`` (``model.save_cache_output``), SPLIT as in
        :func:`_cache_fwd_split_kernel` (1: not split)."""
        _cache_fwd_core(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                        gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr,
                        blk_len_ptr, oc_ptr, H, NQT, scale, W, D, BM, BN, DOT_PREC, False, SPLIT, True)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_fwd_split_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, H, NQT, scale, W,
                                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                DOT_PREC: tl.constexpr, SPLIT: tl.constexpr):
        """The fresh call's forward with the output columns split over SPLIT programs (a launch candidate)."""
        _cache_fwd_core(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                        gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr,
                        blk_len_ptr, o_ptr, H, NQT, scale, W, D, BM, BN, DOT_PREC, False, SPLIT, False)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_fwd_pre_kernel(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                              sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, ka_ptr, va_ptr, rka_ptr,
                              pre_start_ptr, pre_len_ptr, H, NQT, scale, W,
                              D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              DOT_PREC: tl.constexpr):
        _cache_fwd_core(q_ptr, k_ptr, v_ptr, os_ptr, o_ptr, lse_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr, sink_ptr,
                        gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, ka_ptr, va_ptr, rka_ptr, pre_start_ptr,
                        pre_len_ptr, o_ptr, H, NQT, scale, W, D, BM, BN, DOT_PREC, True, 1, False)

    @triton.jit
    def _norm_bwd(b_dy, b_x, b_r, b_g, D: tl.constexpr):
        """RMSNorm backward: y = x r g. Returns (dx, per-row contributions summed into dgamma)."""
        b_gdy = b_g[None, :] * b_dy
        b_dx = b_r[:, None] * b_gdy - b_x * (b_r * b_r * b_r / D)[:, None] * tl.sum(b_x * b_gdy, axis=1)[:, None]
        return b_dx, tl.sum(b_dy * b_x * b_r[:, None], axis=0)

    @triton.jit
    def _dq_tile(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_k, b_v, b_rk, b_ok, b_lam, DOT_PREC: tl.constexpr):
        """One key tile of the dq pass: ``b_r += sum_j p <do, v_j>``, ``b_dq += sum_j p dp kc_j``, ``b_pk += sum_j
        p kc_j`` (kc_j = k_j r_k; the gammas and the scale are applied at the end)."""
        b_s = tl.dot(b_qs, tl.trans(b_k), input_precision=DOT_PREC) * b_rk[None, :]
        b_p = tl.where(b_ok, tl.exp2(b_s - b_lse[:, None]), 0.0)
        b_dov = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_r += tl.sum(b_p * b_dov, axis=1)
        b_prk = b_p * b_rk[None, :]
        b_dq += tl.dot((b_prk * (b_dov * b_lam)).to(b_k.dtype), b_k, input_precision=DOT_PREC)
        b_pk += tl.dot(b_prk.to(b_k.dtype), b_k, input_precision=DOT_PREC)
        return b_r, b_dq, b_pk

    @triton.jit
    def _dq_tile_known(b_qs, b_do, b_lse, b_r, b_dq, b_delta, b_k, b_v, b_rk, b_ok, b_lam, MODE: tl.constexpr,
                       DOT_PREC: tl.constexpr):
        """A key tile of the two-pass dq: ``MODE`` 1 sums ``b_r`` only; ``MODE`` 2, with ``delta`` known,
        ``b_dq += sum_j p (dp - delta) kc_j`` (one [BM, D] accumulator instead of two)."""
        b_s = tl.dot(b_qs, tl.trans(b_k), input_precision=DOT_PREC) * b_rk[None, :]
        b_p = tl.where(b_ok, tl.exp2(b_s - b_lse[:, None]), 0.0)
        b_dov = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        if MODE == 1:
            b_r += tl.sum(b_p * b_dov, axis=1)
        else:
            b_ds = b_p * b_rk[None, :] * (b_dov * b_lam - b_delta[:, None])
            b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC)
        return b_r, b_dq

    @triton.jit
    def _dq_step(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_delta, b_k, b_v, b_rk, b_ok, b_lam, MODE: tl.constexpr,
                 DOT_PREC: tl.constexpr):
        """One key tile of a dq pass: ``MODE`` 0 the one-pass sums (:func:`_dq_tile`), 1 and 2 the two-pass ones
        (:func:`_dq_tile_known`; ``b_pk`` untouched)."""
        if MODE == 0:
            b_r, b_dq, b_pk = _dq_tile(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_k, b_v, b_rk, b_ok, b_lam, DOT_PREC)
        else:
            b_r, b_dq = _dq_tile_known(b_qs, b_do, b_lse, b_r, b_dq, b_delta, b_k, b_v, b_rk, b_ok, b_lam, MODE,
                                       DOT_PREC)
        return b_r, b_dq, b_pk

    @triton.jit
    def _dq_pass(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, sel_ptr, b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_delta,
                 b_lam, i_b, i_h, start, length, pre_start, pre, q0, o_m, m_ok, H, W, D: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, DOT_PREC: tl.constexpr,
                 HAS_PRE: tl.constexpr):
        """A dq pass over the query tile's keys (cache slots, then the block's own); ``MODE`` as in
        :func:`_dq_step`."""
        if W > 0:
            for c0 in range(0, W, BN):
                o_n, t_ok, row, a_ok, row_a = _cache_rows(sel_ptr, i_b, i_h, c0, H, W, BN, HAS_PRE)
                b_k, b_v, b_rk = _load_two(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a,
                                           a_ok, D, HAS_PRE, D, 0)
                b_ok = (t_ok | a_ok)[None, :] & m_ok[:, None]
                b_r, b_dq, b_pk = _dq_step(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_delta, b_k, b_v, b_rk, b_ok, b_lam,
                                           MODE, DOT_PREC)
        hi = tl.minimum(q0 + BM, length) + pre
        mid = _prefix_tiles_end(pre, hi, BN, HAS_PRE)
        if HAS_PRE:
            b_r, b_dq, b_pk = _dq_block_loop(0, mid, k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, b_qs, b_do, b_lse,
                                             b_r, b_dq, b_pk, b_delta, b_lam, i_h, start, length, pre_start, pre, o_m,
                                             m_ok, H, D, BN, MODE, DOT_PREC, True)
        b_r, b_dq, b_pk = _dq_block_loop(mid, hi, k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, b_qs, b_do, b_lse,
                                         b_r, b_dq, b_pk, b_delta, b_lam, i_h, start, length, pre_start, pre, o_m,
                                         m_ok, H, D, BN, MODE, DOT_PREC, False)
        return b_r, b_dq, b_pk

    @triton.jit
    def _dq_block_loop(lo, hi, k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, b_qs, b_do, b_lse, b_r, b_dq, b_pk,
                       b_delta, b_lam, i_h, start, length, pre_start, pre, o_m, m_ok, H, D: tl.constexpr,
                       BN: tl.constexpr, MODE: tl.constexpr, DOT_PREC: tl.constexpr, TWO: tl.constexpr):
        """A dq pass over the block's own key tiles at positions ``lo ... hi`` (``TWO`` as in :func:`_own_rows`)."""
        for c0 in range(lo, hi, BN):
            o_n, t_ok, row, a_ok, row_a = _own_rows(start, length, pre_start, pre, c0, H, i_h, BN, TWO)
            b_k, b_v, b_rk = _load_two(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row, t_ok, row_a, a_ok, D, TWO,
                                       D, 0)
            b_ok = (t_ok | a_ok)[None, :] & m_ok[:, None] & (o_n[None, :] <= o_m[:, None] + pre)
            b_r, b_dq, b_pk = _dq_step(b_qs, b_do, b_lse, b_r, b_dq, b_pk, b_delta, b_k, b_v, b_rk, b_ok, b_lam,
                                       MODE, DOT_PREC)
        return b_r, b_dq, b_pk

    @triton.jit
    def _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                           dgate_ptr, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr, oc_ptr, H, NQT, scale, W,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_PREC: tl.constexpr,
                           HAS_PRE: tl.constexpr, TWO_PASS: tl.constexpr, DELTA_ONLY: tl.constexpr,
                           HAS_OC: tl.constexpr):
        """``TWO_PASS``: sum ``delta`` over the keys first, then dq with it (the keys are read and q k^T, do v^T
        formed twice, for one [BM, D] accumulator instead of two). ``DELTA_ONLY``: that first pass alone, with
        ``delta`` and the sink and gate partials written; dq and its gamma_q partial come from the dk/dv programs'
        sums (the DQ_ATOMIC variant, :func:`_cache_bwd_dq_finish_kernel`). ``HAS_OC``: ``delta`` from the forward's
        saved ``o_cache`` (``oc``, one row sum), no pass over the keys for it; then dq in one pass with ``delta``
        known (one [BM, D] accumulator), unless ``DELTA_ONLY``."""
        pid, i_h, i_b, q0, start, length = _query_block(blk_start_ptr, blk_len_ptr, NQT, BM, 1)
        if q0 >= length:  # past the block's end: zero partials (the buffers are not zero-filled first)
            if not DELTA_ONLY:
                tl.store(dgq_ptr + (pid * H + i_h) * D + tl.arange(0, D), tl.zeros([D], dtype=tl.float32))
            tl.store(dsink_ptr + pid * H + i_h, 0.0)
            tl.store(dgate_ptr + pid * H + i_h, 0.0)
        else:
            pre_start, pre = _prefix(pre_start_ptr, pre_len_ptr, i_b, HAS_PRE)
            o_m, m_ok, o_d, row_q, p_q, b_q, b_rq, b_gq, b_gk, b_qs = _query_tile(
                q_ptr, rq_ptr, gq_ptr, gk_ptr, i_h, start, length, q0, H, scale, D, BM)
            b_do = tl.load(do_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_lse = tl.load(lse_ptr + row_q, mask=m_ok, other=0.0)
            b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
            b_r = tl.zeros([BM], dtype=tl.float32)
            if HAS_OC or TWO_PASS or DELTA_ONLY:
                b_none = tl.zeros([BM, 16], dtype=tl.float32)  # no dq (nor sum of p kc) while delta is formed
                if HAS_OC:  # the row sums from the kept output: no pass over the keys
                    b_oc = tl.load(oc_ptr + p_q, mask=m_ok[:, None], other=0.0)
                    b_r = tl.sum(b_do.to(tl.float32) * b_oc.to(tl.float32), axis=1)
                else:
                    b_r, b_none, b_none = _dq_pass(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, sel_ptr, b_qs,
                                                   b_do, b_lse, b_r, b_none, b_none, b_r, b_lam, i_b, i_h, start,
                                                   length, pre_start, pre, q0, o_m, m_ok, H, W, D, BM, BN, 1,
                                                   DOT_PREC, HAS_PRE)
                b_delta = b_lam * b_r
                if not DELTA_ONLY:
                    b_dq = tl.zeros([BM, D], dtype=tl.float32)
                    b_r, b_dqr, b_none = _dq_pass(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, sel_ptr, b_qs,
                                                  b_do, b_lse, b_r, b_dq, b_none, b_delta, b_lam, i_b, i_h, start,
                                                  length, pre_start, pre, q0, o_m, m_ok, H, W, D, BM, BN, 2, DOT_PREC,
                                                  HAS_PRE)
            else:
                b_zero = tl.zeros([BM, D], dtype=tl.float32)
                b_r, b_dq, b_pk = _dq_pass(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, sel_ptr, b_qs, b_do, b_lse,
                                           b_r, b_zero, b_zero, b_r, b_lam, i_b, i_h, start, length, pre_start, pre,
                                           q0, o_m, m_ok, H, W, D, BM, BN, 0, DOT_PREC, HAS_PRE)
                b_delta = b_lam * b_r
                b_dqr = b_dq - b_delta[:, None] * b_pk
            tl.store(delta_ptr + row_q, b_delta, mask=m_ok)
            b_psink = tl.exp2(tl.load(sink_ptr + i_h).to(tl.float32) * 1.4426950408889634 - b_lse)
            tl.store(dsink_ptr + pid * H + i_h, -tl.sum(tl.where(m_ok, b_psink * b_delta, 0.0), axis=0))
            tl.store(dgate_ptr + pid * H + i_h, tl.sum(b_r, axis=0) * b_lam * (1.0 - b_lam))
            if not DELTA_ONLY:
                # q and the gammas read again for the epilogue rather than kept through the loops (registers at
                # D = 256; after the stores above, so that the compiler does not reuse the first reads).
                _dq_epilogue(b_dqr, q_ptr, gq_ptr, gk_ptr, dq_ptr, dgq_ptr, p_q, m_ok, o_d, b_rq, pid, i_h, H, scale,
                             D)

    @triton.jit
    def _dq_epilogue(b_dqr, q_ptr, gq_ptr, gk_ptr, dq_ptr, dgq_ptr, p_q, m_ok, o_d, b_rq, pid, i_h, H, scale,
                     D: tl.constexpr):
        """dq through the query RMSNorm's backward from ``b_dqr`` = sum_j p (dp - delta) kc_j (gamma_k and the scale
        applied here), and the tile's partial gamma_q sum."""
        b_q = tl.load(q_ptr + p_q, mask=m_ok[:, None], other=0.0)
        b_gq = tl.load(gq_ptr + o_d).to(tl.float32)
        b_gk = tl.load(gk_ptr + o_d).to(tl.float32)
        b_dx, b_dg = _norm_bwd(b_dqr * (scale * b_gk)[None, :], b_q.to(tl.float32), b_rq, b_gq, D)
        tl.store(dq_ptr + p_q, b_dx.to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(dgq_ptr + (pid * H + i_h) * D + o_d, b_dg)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                             dgate_ptr, H, NQT, scale, W,
                             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             DOT_PREC: tl.constexpr):
        """dq of a query tile, its ``delta`` (written for the dk/dv programs) and its partial sink and gate
        gradients (see the module docstring)."""
        _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                           dgate_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, do_ptr, H, NQT, scale, W, D,
                           BM, BN, DOT_PREC, False, False, False, False)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_dq_two_pass_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr,
                                      gk_ptr, sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr,
                                      dsink_ptr, dgate_ptr, H, NQT, scale, W,
                                      D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                      DOT_PREC: tl.constexpr):
        """The fresh call's dq in two passes over the keys (a launch candidate)."""
        _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                           dgate_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, do_ptr, H, NQT, scale, W, D,
                           BM, BN, DOT_PREC, False, True, False, False)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_delta_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dsink_ptr, dgate_ptr, H, NQT,
                                scale, W, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                DOT_PREC: tl.constexpr):
        """The fresh call's ``delta`` and sink and gate partials alone, from one pass of two products over the keys
        (the DQ_ATOMIC variant; dq and its gamma_q partial come after the dk/dv programs)."""
        _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, do_ptr, dsink_ptr, dsink_ptr,
                           dgate_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, do_ptr, H, NQT, scale, W, D,
                           BM, BN, DOT_PREC, False, False, True, False)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_dq_oc_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                                dgate_ptr, oc_ptr, H, NQT, scale, W, D: tl.constexpr, BM: tl.constexpr,
                                BN: tl.constexpr, DOT_PREC: tl.constexpr, DELTA_ONLY: tl.constexpr):
        """The fresh call's dq pass with ``delta`` from the saved ``o_cache`` (``model.save_cache_output``): three
        products per pair and one [BM, D] accumulator; with ``DELTA_ONLY`` (the DQ_ATOMIC variant) no products at
        all, only ``delta`` and the sink and gate partials."""
        _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                           dgate_ptr, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, oc_ptr, H, NQT, scale, W, D,
                           BM, BN, DOT_PREC, False, False, DELTA_ONLY, True)

    @triton.jit(do_not_specialize=["H", "NQT"])
    def _cache_bwd_dq_finish_kernel(dqa_ptr, q_ptr, rq_ptr, gq_ptr, gk_ptr, blk_start_ptr, blk_len_ptr, dq_ptr,
                                    dgq_ptr, H, NQT, scale, D: tl.constexpr, BM: tl.constexpr):
        """dq of a query tile from the float32 sums that the dk/dv programs added into ``dqa`` (the DQ_ATOMIC
        variant), through the query RMSNorm's backward, and the tile's partial gamma_q sum."""
        pid, i_h, i_b, q0, start, length = _query_block(blk_start_ptr, blk_len_ptr, NQT, BM, 1)
        o_d = tl.arange(0, D)
        if q0 >= length:  # past the block's end: a zero partial (the buffer is not zero-filled first)
            tl.store(dgq_ptr + (pid * H + i_h) * D + o_d, tl.zeros([D], dtype=tl.float32))
        else:
            o_m = q0 + tl.arange(0, BM)
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            p_q = row_q[:, None] * D + o_d[None, :]
            b_dqr = tl.load(dqa_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_rq = tl.load(rq_ptr + row_q, mask=m_ok, other=0.0)
            _dq_epilogue(b_dqr, q_ptr, gq_ptr, gk_ptr, dq_ptr, dgq_ptr, p_q, m_ok, o_d, b_rq, pid, i_h, H, scale, D)

    @triton.jit(do_not_specialize=["H", "NQT", "W"])
    def _cache_bwd_dq_pre_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                 sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr,
                                 dsink_ptr, dgate_ptr, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr, H, NQT,
                                 scale, W, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 DOT_PREC: tl.constexpr):
        _cache_bwd_dq_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                           sink_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dq_ptr, dgq_ptr, dsink_ptr,
                           dgate_ptr, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr, do_ptr, H, NQT, scale, W,
                           D, BM, BN, DOT_PREC, True, False, False, False)

    @triton.jit
    def _dkdv_loop(q_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, b_ks, b_v, b_lam, n_ok, o_n, is_cache, start, length,
                   lo, pre, i_h, H, b_k, b_rk, dqa_ptr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   DOT_PREC: tl.constexpr, MODE: tl.constexpr):
        """A key tile's sums over its queries: ``MODE`` 0 both dk and dv, 1 dv only, 2 dk only (the one not
        formed comes back as a [BN, 16] zero); 3 both, and each query tile's share of dq, ``sum_j p (dp - delta)
        kc_j`` from the raw keys ``b_k`` and their rstd ``b_rk``, added into the float32 rows of ``dqa`` (atomic
        adds: every key tile of the block adds into the same query rows)."""
        o_d = tl.arange(0, D)
        b_dk = tl.zeros([BN, D if MODE != 1 else 16], dtype=tl.float32)
        b_dv = tl.zeros([BN, D if MODE != 2 else 16], dtype=tl.float32)
        for m0 in range(lo, length, BM):
            o_m = m0 + tl.arange(0, BM)
            m_ok = o_m < length
            row_q = (start + o_m) * H + i_h
            p_q = row_q[:, None] * D + o_d[None, :]
            b_q = tl.load(q_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_do = tl.load(do_ptr + p_q, mask=m_ok[:, None], other=0.0)
            b_rq = tl.load(rq_ptr + row_q, mask=m_ok, other=0.0)
            b_lse = tl.load(lse_ptr + row_q, mask=m_ok, other=0.0)
            if MODE != 1:
                b_delta = tl.load(delta_ptr + row_q, mask=m_ok, other=0.0)
            b_st = tl.dot(b_ks, tl.trans(b_q), input_precision=DOT_PREC) * b_rq[None, :]
            b_ok = n_ok[:, None] & m_ok[None, :] & (is_cache | (o_m[None, :] + pre >= o_n[:, None]))
            b_pt = tl.where(b_ok, tl.exp2(b_st - b_lse[None, :]), 0.0)
            if MODE != 2:
                b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PREC)
            if MODE != 1:
                b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC) * b_lam
                b_dst = b_pt * (b_dpt - b_delta[None, :])
                b_dk += tl.dot((b_dst * b_rq[None, :]).to(b_q.dtype), b_q, input_precision=DOT_PREC)
                if MODE == 3:
                    b_dqt = tl.dot(tl.trans((b_dst * b_rk[:, None]).to(b_k.dtype)), b_k, input_precision=DOT_PREC)
                    tl.atomic_add(dqa_ptr + p_q, b_dqt, mask=m_ok[:, None], sem="relaxed")
        return b_dk, b_dv

    @triton.jit
    def _load_k_again(k_ptr, rk_ptr, ka_ptr, rka_ptr, p_k, row_k, t_ok, p_a, row_a, a_ok, HAS_PRE: tl.constexpr):
        """k and its rstd read again for the epilogue (``p_k``, ``p_a``: the tile's element offsets). An eviction
        hint makes these loads differ from the first ones: identical loads with no store between them (the dk-only
        launch stores nothing before) are merged by the compiler, which keeps the first read live through the loop
        instead."""
        b_k = tl.load(k_ptr + p_k, mask=t_ok[:, None], other=0.0, eviction_policy="evict_first")
        b_rk = tl.load(rk_ptr + row_k, mask=t_ok, other=0.0, eviction_policy="evict_first")
        if HAS_PRE:
            b_ka = tl.load(ka_ptr + p_a, mask=a_ok[:, None], other=0.0, eviction_policy="evict_first")
            b_rka = tl.load(rka_ptr + row_a, mask=a_ok, other=0.0, eviction_policy="evict_first")
            b_k = tl.where(a_ok[:, None], b_ka, b_k)
            b_rk = tl.where(a_ok, b_rka, b_rk)
        return b_k, b_rk

    @triton.jit
    def _store_grads(b_dk, b_dv, k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, gq_ptr, gk_ptr, b_lam, scale,
                     is_cache, o_n, t_ok, row_k, a_ok, row_a, i_b, i_h, pid, H, W, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                     dgk_ptr, dest_ptr, dka_ptr, dva_ptr, SENTINEL, A_BASE, D: tl.constexpr, HAS_PRE: tl.constexpr,
                     MODE: tl.constexpr):
        """A key tile's sums written (``MODE`` as in :func:`_dkdv_loop`): dv scaled by the gate, then dk through its
        RMSNorm's backward with its partial gamma_k sum; their rows (in-block tiles) or their slots' partials and
        destination rows (cache tiles). dv goes first, and k and the gammas are read again after it: kept through
        the loop, they cost registers at D = 256 (read again before a store, the compiler reuses the first read)."""
        o_d = tl.arange(0, D)
        p_e = ((i_b * H + i_h) * W + o_n)[:, None] * D + o_d[None, :]
        e_ok = (o_n < W)[:, None]
        p_k = row_k[:, None] * D + o_d[None, :]
        p_a = row_a[:, None] * D + o_d[None, :]
        if MODE != 2:
            b_dv = b_dv * b_lam
            if is_cache:
                tl.store(pdv_ptr + p_e, b_dv, mask=e_ok)
            else:
                tl.store(dv_ptr + p_k, b_dv.to(dv_ptr.dtype.element_ty), mask=t_ok[:, None])
                if HAS_PRE:
                    tl.store(dva_ptr + p_a, b_dv.to(dva_ptr.dtype.element_ty), mask=a_ok[:, None])
        if MODE != 1:
            b_k, b_rk = _load_k_again(k_ptr, rk_ptr, ka_ptr, rka_ptr, p_k, row_k, t_ok, p_a, row_a, a_ok, HAS_PRE)
            b_gq = tl.load(gq_ptr + o_d, eviction_policy="evict_first").to(tl.float32)
            b_gk = tl.load(gk_ptr + o_d, eviction_policy="evict_first").to(tl.float32)
            b_dx, b_dg = _norm_bwd(b_dk * (scale * b_gq)[None, :], b_k.to(tl.float32), b_rk, b_gk, D)
            tl.store(dgk_ptr + (pid * H + i_h) * D + o_d, b_dg)
            if is_cache:
                tl.store(pdk_ptr + p_e, b_dx, mask=e_ok)
                # The reduction's key: token rows as they are, prefix rows after all token rows.
                dest = tl.where(t_ok, row_k, SENTINEL)
                if HAS_PRE:
                    dest = tl.where(a_ok, A_BASE + row_a, dest)
                tl.store(dest_ptr + (i_b * H + i_h) * W + o_n, dest, mask=o_n < W)
            else:
                tl.store(dk_ptr + p_k, b_dx.to(dk_ptr.dtype.element_ty), mask=t_ok[:, None])
                if HAS_PRE:
                    tl.store(dka_ptr + p_a, b_dx.to(dka_ptr.dtype.element_ty), mask=a_ok[:, None])

    @triton.jit
    def _cache_bwd_dkdv_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                             dgk_ptr, dest_ptr, SENTINEL, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr,
                             dka_ptr, dva_ptr, A_BASE, dqa_ptr, H, NKT, NCT, scale, W,
                             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_PREC: tl.constexpr,
                             HAS_PRE: tl.constexpr, MODE: tl.constexpr):
        """``MODE`` 0: a key tile's dk and dv; 1: its dv only, 2: its dk only (two launches, each program with one
        [BN, D] accumulator instead of two; the key tile's q k^T formed in both); 3: dk, dv and the tile's share
        of dq, added into ``dqa`` (see :func:`_dkdv_loop`)."""
        pid = tl.program_id(0)
        i_h = tl.program_id(1).to(tl.int64)
        i_b = (pid // NKT).to(tl.int64)
        j = pid % NKT
        start = tl.load(blk_start_ptr + i_b).to(tl.int64)
        length = tl.load(blk_len_ptr + i_b)
        pre_start, pre = _prefix(pre_start_ptr, pre_len_ptr, i_b, HAS_PRE)
        is_cache = j < NCT
        c0 = tl.where(is_cache, j, j - NCT) * BN
        if (c0 >= length + pre) & (j >= NCT):  # past the block's end: a zero partial (the buffer is not zero-filled)
            if MODE != 1:
                tl.store(dgk_ptr + (pid * H + i_h) * D + tl.arange(0, D), tl.zeros([D], dtype=tl.float32))
        else:
            # Queries from the first whose position in the block (pre + index) reaches the tile's first key.
            lo = tl.where(is_cache, 0, (tl.maximum(c0 - pre, 0) // BM) * BM)
            o_d = tl.arange(0, D)
            if is_cache:
                o_n, t_ok, row_k, a_ok, row_a = _cache_rows(sel_ptr, i_b, i_h, c0, H, W, BN, HAS_PRE)
            else:
                o_n, t_ok, row_k, a_ok, row_a = _block_rows(start, length, pre_start, pre, c0, H, i_h, BN, HAS_PRE)
            n_ok = t_ok | a_ok
            b_k, b_v, b_rk = _both(k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, row_k, t_ok, row_a, a_ok, D,
                                   HAS_PRE, D, 0)
            b_gq = tl.load(gq_ptr + o_d).to(tl.float32)
            b_gk = tl.load(gk_ptr + o_d).to(tl.float32)
            b_ks = (b_k.to(tl.float32) * b_rk[:, None] * (b_gq * b_gk)[None, :] * (scale * 1.4426950408889634))
            b_ks = b_ks.to(b_k.dtype)
            b_lam = tl.sigmoid(tl.load(gate_ptr + i_h).to(tl.float32))
            b_dk, b_dv = _dkdv_loop(q_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, b_ks, b_v, b_lam, n_ok, o_n, is_cache,
                                    start, length, lo, pre, i_h, H, b_k, b_rk, dqa_ptr, D, BM, BN, DOT_PREC, MODE)
            _store_grads(b_dk, b_dv, k_ptr, v_ptr, rk_ptr, ka_ptr, va_ptr, rka_ptr, gq_ptr, gk_ptr, b_lam, scale,
                         is_cache, o_n, t_ok, row_k, a_ok, row_a, i_b, i_h, pid, H, W, dk_ptr, dv_ptr, pdk_ptr,
                         pdv_ptr, dgk_ptr, dest_ptr, dka_ptr, dva_ptr, SENTINEL, A_BASE, D, HAS_PRE, MODE)

    @triton.jit(do_not_specialize=["H", "NKT", "NCT", "W"])
    def _cache_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                               gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                               dgk_ptr, dest_ptr, SENTINEL, H, NKT, NCT, scale, W,
                               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               DOT_PREC: tl.constexpr):
        """One key tile: cache tiles (j < NCT) read by all queries of the block, then in-block tiles. A cache tile
        also writes the destination row (token * H + head, ``SENTINEL`` for an empty slot) of each of its slots, the
        keys the reduction of the cache partials sorts by."""
        _cache_bwd_dkdv_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                             dgk_ptr, dest_ptr, SENTINEL, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, dk_ptr,
                             dv_ptr, SENTINEL, pdk_ptr, H, NKT, NCT, scale, W, D, BM, BN, DOT_PREC, False, 0)

    @triton.jit(do_not_specialize=["H", "NKT", "NCT", "W"])
    def _cache_bwd_dkdv_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                  gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                                  dgk_ptr, dest_ptr, SENTINEL, dqa_ptr, H, NKT, NCT, scale, W,
                                  D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                  DOT_PREC: tl.constexpr):
        """The fresh call's key tile as in :func:`_cache_bwd_dkdv_kernel`, also adding its share of dq into the
        float32 ``dqa`` (the DQ_ATOMIC variant: one more product per pair here, the dq pass's four saved)."""
        _cache_bwd_dkdv_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                             dgk_ptr, dest_ptr, SENTINEL, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, dk_ptr,
                             dv_ptr, SENTINEL, dqa_ptr, H, NKT, NCT, scale, W, D, BM, BN, DOT_PREC, False, 3)

    @triton.jit(do_not_specialize=["H", "NKT", "NCT", "W"])
    def _cache_bwd_dkdv_separate_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr,
                                        gk_ptr, gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr,
                                        pdv_ptr, dgk_ptr, dest_ptr, SENTINEL, H, NKT, NCT, scale, W,
                                        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                        DOT_PREC: tl.constexpr, MODE: tl.constexpr):
        """The fresh call's dv (``MODE`` 1) or dk (2) alone: dk and dv in two launches (a launch candidate)."""
        _cache_bwd_dkdv_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                             dgk_ptr, dest_ptr, SENTINEL, k_ptr, v_ptr, rk_ptr, blk_start_ptr, blk_len_ptr, dk_ptr,
                             dv_ptr, SENTINEL, pdk_ptr, H, NKT, NCT, scale, W, D, BM, BN, DOT_PREC, False, MODE)

    @triton.jit(do_not_specialize=["H", "NKT", "NCT", "W"])
    def _cache_bwd_dkdv_pre_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                                   gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                                   dgk_ptr, dest_ptr, SENTINEL, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr,
                                   dka_ptr, dva_ptr, A_BASE, H, NKT, NCT, scale, W,
                                   D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                   DOT_PREC: tl.constexpr):
        _cache_bwd_dkdv_core(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, rq_ptr, rk_ptr, gq_ptr, gk_ptr,
                             gate_ptr, sel_ptr, blk_start_ptr, blk_len_ptr, dk_ptr, dv_ptr, pdk_ptr, pdv_ptr,
                             dgk_ptr, dest_ptr, SENTINEL, ka_ptr, va_ptr, rka_ptr, pre_start_ptr, pre_len_ptr,
                             dka_ptr, dva_ptr, A_BASE, pdk_ptr, H, NKT, NCT, scale, W, D, BM, BN, DOT_PREC, True, 0)

    @triton.jit
    def _scatter_core(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, dka_ptr, dva_ptr, E, SENTINEL, A_BASE,
                      D: tl.constexpr, HAS_PRE: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        key = tl.load(key_ptr + p)
        prev = tl.load(key_ptr + p - 1, mask=p > 0, other=-1)
        if (key != SENTINEL) & (prev != key):
            o_d = tl.arange(0, D)
            b_dk = tl.zeros([D], dtype=tl.float32)
            b_dv = tl.zeros([D], dtype=tl.float32)
            i = p
            cur = key
            while cur == key:
                e = tl.load(order_ptr + i)
                b_dk += tl.load(pdk_ptr + e * D + o_d)
                b_dv += tl.load(pdv_ptr + e * D + o_d)
                i += 1
                cur = tl.load(key_ptr + i, mask=i < E, other=-1)
            if HAS_PRE:
                if key >= A_BASE:
                    p_r = (key - A_BASE) * D + o_d
                    tl.store(dka_ptr + p_r, (tl.load(dka_ptr + p_r).to(tl.float32)
                                             + b_dk).to(dka_ptr.dtype.element_ty))
                    tl.store(dva_ptr + p_r, (tl.load(dva_ptr + p_r).to(tl.float32)
                                             + b_dv).to(dva_ptr.dtype.element_ty))
                else:
                    p_r = key * D + o_d
                    tl.store(dk_ptr + p_r, (tl.load(dk_ptr + p_r).to(tl.float32) + b_dk).to(dk_ptr.dtype.element_ty))
                    tl.store(dv_ptr + p_r, (tl.load(dv_ptr + p_r).to(tl.float32) + b_dv).to(dv_ptr.dtype.element_ty))
            else:
                p_r = key * D + o_d
                tl.store(dk_ptr + p_r, (tl.load(dk_ptr + p_r).to(tl.float32) + b_dk).to(dk_ptr.dtype.element_ty))
                tl.store(dv_ptr + p_r, (tl.load(dv_ptr + p_r).to(tl.float32) + b_dv).to(dv_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["E"])
    def _scatter_cache_grads_kernel(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, E, SENTINEL,
                                    D: tl.constexpr):
        """Add the cache partials of one destination row in a fixed order (the heads of sorted runs do the work)."""
        _scatter_core(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, dk_ptr, dv_ptr, E, SENTINEL, SENTINEL, D,
                      False)

    @triton.jit(do_not_specialize=["E"])
    def _scatter_cache_grads_pre_kernel(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, dka_ptr, dva_ptr, E,
                                        SENTINEL, A_BASE, D: tl.constexpr):
        """The same, with keys from ``A_BASE`` on naming prefix rows (``key - A_BASE``)."""
        _scatter_core(key_ptr, order_ptr, pdk_ptr, pdv_ptr, dk_ptr, dv_ptr, dka_ptr, dva_ptr, E, SENTINEL, A_BASE, D,
                      True)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else None


def rms_rstd(x: torch.Tensor) -> torch.Tensor:
    """``rsqrt(mean(x^2) + eps)`` over the last dim of a contiguous ``[..., D]`` tensor, float32 ``[...]``."""
    d = x.shape[-1]
    rows = x.numel() // d
    r = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    br = 16 if x.device.type != "cuda" else max(1, 4096 // d)
    if rows:
        _rstd_kernel[(triton.cdiv(rows, br),)](x, r, rows, NORM_EPS, D=d, BR=br, num_warps=4)
    return r


class Prefix(NamedTuple):
    """Key rows read ahead of the token rows (a call that continues from a cache): ``k``, ``v`` ``[A, H, D]`` (the
    cache's entries and unfinished block, contiguous), and per block of the table the first prefix row ``start`` and
    the number of prefix rows ``length`` (int32 ``[NB]``) that come before the block's own tokens. A selection
    entry ``-2 - a`` names prefix row ``a``. Prefix rows are keys only, never queries."""

    k: torch.Tensor
    v: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor


def _check_prefix(prefix: Prefix, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernels read a key tile from either source through one pointer (``_two``): same element types."""
    if prefix.k.dtype != k.dtype or prefix.v.dtype != v.dtype:
        raise ValueError(f"prefix: k and v in {prefix.k.dtype} / {prefix.v.dtype}, the tokens' in {k.dtype} / "
                         f"{v.dtype}; they must match")


def cache_attention_fwd(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, *, block: int,
                        window: int, prefix: Prefix | None = None, save_output: bool = False):
    """Forward launches. Returns ``(o, lse [B*T, H] base 2, r_q, r_k)``: what the backward needs besides the
    inputs (no cache output: the backward forms ``delta`` itself); with a ``prefix``, its rows' rstd after them;
    with ``save_output`` (fresh calls), the cache read's own output ``o_cache`` (q's shape and dtype) after them,
    from which the backward forms ``delta`` without a pass over the keys.
    A block's ``blk_len`` counts its queries (its token rows); its keys are its prefix rows, then those."""
    h, d = q.shape[-2], q.shape[-1]
    num_blocks = blk_start.shape[0]
    rq, rk = rms_rstd(q), rms_rstd(k)
    o = _empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = _empty(*q.shape[:-1], dtype=torch.float32, device=q.device)
    sel = sel if sel.numel() else blk_start  # window 0: never read, but Triton needs a valid pointer
    if save_output and prefix is not None:
        raise ValueError("save_output: a call continuing from a cache (prefix) does not keep o_cache")
    # (o_state is only read in the epilogue, in whatever dtype it comes.)
    if num_blocks and _launch_choice(FORWARD, "forward", d, _common_dtype(q, k, v), q.device,
                                     prefix is not None) == "gluon":
        from hola_titan.kernels.hola import gluon_kernels as gluon_attn
        fcfg = gluon_attn.FWD_CONFIG
        nqt = triton.cdiv(block, fcfg["BM"])
        oc = _empty(*q.shape, dtype=q.dtype, device=q.device) if save_output else o
        gluon_attn._cache_fwd_gluon_kernel[(num_blocks * nqt, h)](
            q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, oc, h, nqt,
            d ** -0.5, window, D=d, BM=fcfg["BM"], BN=fcfg["BN"], STORE_OC=save_output, num_warps=fcfg["num_warps"])
        return (o, lse, rq, rk, oc) if save_output else (o, lse, rq, rk)
    cfg = _config("fwd", d, q.dtype, q.device)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nqt = triton.cdiv(block, bm)
    split = cfg.pop("SPLIT", 1)
    common = dict(W=window, D=d, BM=bm, BN=bn, DOT_PREC=_dot_precision(q.dtype), **cfg)
    if save_output:
        oc = _empty(*q.shape, dtype=q.dtype, device=q.device)
        if num_blocks:
            _cache_fwd_oc_kernel[(num_blocks * nqt, h * split)](
                q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, oc,
                h, nqt, d ** -0.5, SPLIT=split, **common)
        return o, lse, rq, rk, oc
    if prefix is None:
        if num_blocks and split == 1:
            _cache_fwd_kernel[(num_blocks * nqt, h)](
                q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len,
                h, nqt, d ** -0.5, **common)
        elif num_blocks:
            _cache_fwd_split_kernel[(num_blocks * nqt, h * split)](
                q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len,
                h, nqt, d ** -0.5, SPLIT=split, **common)
        return o, lse, rq, rk
    _check_prefix(prefix, k, v)
    rka = rms_rstd(prefix.k)
    if num_blocks:
        _cache_fwd_pre_kernel[(num_blocks * nqt, h)](
            q, k, v, o_state, o, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len,
            prefix.k, prefix.v, rka, prefix.start, prefix.length, h, nqt, d ** -0.5, **common)
    return o, lse, rq, rk, rka


def _dq_partials(rows: int, h: int, d: int, device):
    """The dq programs' per-program partial sums of the gamma_q, sink and gate gradients (every one written, zeros
    past a block's end: no fill launches)."""
    return (_empty(rows, h, d, dtype=torch.float32, device=device), _empty(rows, h, dtype=torch.float32, device=device),
            _empty(rows, h, dtype=torch.float32, device=device))


def _dkdv_partials(num_blocks: int, nkt: int, h: int, window: int, d: int, device):
    """The dk/dv programs' outputs besides dk and dv: the cache slots' float32 partials, their destination rows
    (token * H + head; a prefix row a: A_BASE + a * H + head; empty slots: the sentinel, sorted last), the
    per-program gamma_k partials; and (slots, sentinel)."""
    num_slots = num_blocks * h * window
    pdk = _empty(max(num_slots, 1), d, dtype=torch.float32, device=device)
    pdv = _empty(max(num_slots, 1), d, dtype=torch.float32, device=device)
    dgk_part = _empty(num_blocks * nkt, h, d, dtype=torch.float32, device=device)
    dest = _empty(max(num_slots, 1), dtype=torch.int64, device=device)
    return pdk, pdv, dgk_part, dest, num_slots, torch.iinfo(torch.int64).max


def _common_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The tensors' dtype if they share one (the Gluon kernels' shared-memory products take one), else None."""
    return tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else None


def _reduce_cache_partials(dest, pdk, pdv, dk, dv, num_slots: int, sentinel: int, d: int) -> None:
    """Add the cache slots' float32 partials into the rows they name, in a fixed order (a stable sort by row)."""
    if num_slots:
        dest_sorted, order = torch.sort(dest, stable=True)
        _scatter_cache_grads_kernel[(num_slots,)](dest_sorted, order, pdk, pdv, dk, dv, num_slots, sentinel,
                                                  D=d, num_warps=1 if d <= 64 else 2)


def _cache_attention_bwd_gluon(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, *,
                               block: int, window: int, o_cache: torch.Tensor | None):
    """A fresh call's backward by the Gluon kernels (:mod:`hola_titan.kernels.hola.gluon_kernels`): the same outputs
    as the Triton launches below, from the same partial sums and the same fixed-order reduction of the cache rows."""
    from hola_titan.kernels.hola import gluon_kernels as gluon_attn
    h, d = q.shape[-2], q.shape[-1]
    num_blocks = blk_start.shape[0]
    num_tokens = q.numel() // (h * d)
    device = q.device
    scale = d ** -0.5
    bm, bn, warps = gluon_attn.CONFIG["BM"], gluon_attn.CONFIG["BN"], gluon_attn.CONFIG["num_warps"]
    nqt = triton.cdiv(block, bm)
    nct = triton.cdiv(window, bn)
    nkt = nct + triton.cdiv(block, bn)
    delta = _empty(num_tokens, h, dtype=torch.float32, device=device)
    dq = _empty(*q.shape, dtype=q.dtype, device=device)
    dgq_part, dsink_part, dgate_part = _dq_partials(num_blocks * nqt, h, d, device)
    gluon_attn._cache_bwd_dq_gluon_kernel[(num_blocks * nqt, h)](
        q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq, dgq_part,
        dsink_part, dgate_part, do if o_cache is None else o_cache, h, nqt, scale, window, D=d, BM=bm, BN=bn,
        HAS_OC=o_cache is not None, num_warps=warps)
    dk = _empty(*k.shape, dtype=k.dtype, device=device)
    dv = _empty(*v.shape, dtype=v.dtype, device=device)
    pdk, pdv, dgk_part, dest, num_slots, sentinel = _dkdv_partials(num_blocks, nkt, h, window, d, device)
    gluon_attn._cache_bwd_dkdv_gluon_kernel[(num_blocks * nkt, h)](
        q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv, pdk, pdv,
        dgk_part, dest, sentinel, h, nkt, nct, scale, window, D=d, BM=bm, BN=bn, num_warps=warps)
    _reduce_cache_partials(dest, pdk, pdv, dk, dv, num_slots, sentinel, d)
    return dq, dk, dv, dgq_part.sum((0, 1)), dgk_part.sum((0, 1)), dsink_part.sum(0), dgate_part.sum(0)


def cache_attention_bwd(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, *,
                        block: int, window: int, prefix: Prefix | None = None, rka: torch.Tensor | None = None,
                        o_cache: torch.Tensor | None = None):
    """Backward launches. Returns ``(dq, dk, dv, dgamma_q, dgamma_k, dsink, dgate)`` (parameter grads float32);
    with a ``prefix`` (and its rows' rstd ``rka`` from the forward), ``(dk, dv)`` of its rows after them. With
    ``o_cache`` (the forward's ``save_output``; fresh calls), ``delta`` comes from it instead of a pass over the
    keys."""
    h, d = q.shape[-2], q.shape[-1]
    num_blocks = blk_start.shape[0]
    num_tokens = q.numel() // (h * d)
    device = q.device
    scale = d ** -0.5
    prec = _dot_precision(q.dtype)
    sel = sel if sel.numel() else blk_start  # window 0: never read, but Triton needs a valid pointer
    dkdv_cfg = _config("dkdv" if o_cache is None else "dkdv_kept", d, q.dtype, device)
    separate, dq_atomic = dkdv_cfg.pop("SEPARATE", False), dkdv_cfg.pop("DQ_ATOMIC", False)
    if separate and dq_atomic:
        raise ValueError("cache attention dk/dv launch configuration: SEPARATE and DQ_ATOMIC exclude each other")
    dq_atomic = dq_atomic and prefix is None and not torch.are_deterministic_algorithms_enabled()
    if o_cache is not None and prefix is not None:
        raise ValueError("o_cache: a call continuing from a cache (prefix) does not keep o_cache")
    if o_cache is not None and (o_cache.shape != q.shape or o_cache.dtype != q.dtype or not o_cache.is_contiguous()):
        raise ValueError(f"o_cache: expected q's shape {list(q.shape)} and dtype {q.dtype}, contiguous; got "
                         f"{list(o_cache.shape)} {o_cache.dtype}{'' if o_cache.is_contiguous() else ', strided'}")
    if num_blocks and _launch_choice(BACKWARD, "backward", d,
                                     _common_dtype(q, k, v, do, *(() if o_cache is None else (o_cache,))), device,
                                     prefix is not None) == "gluon":
        return _cache_attention_bwd_gluon(do, q, k, v, lse, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start,
                                          blk_len, block=block, window=window, o_cache=o_cache)
    # Written by the dq programs for every query row of a block; the dk/dv programs read only those rows.
    delta = _empty(num_tokens, h, dtype=torch.float32, device=device)
    dq = _empty(*q.shape, dtype=q.dtype, device=device)
    cfg = _config("dq", d, q.dtype, device)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nqt = triton.cdiv(block, bm)
    dgq_part, dsink_part, dgate_part = _dq_partials(num_blocks * nqt, h, d, device)
    two_pass = cfg.pop("TWO_PASS", False)
    common = dict(W=window, D=d, BM=bm, BN=bn, DOT_PREC=prec, **cfg)
    # The query tiles' grid and launch, which the DQ_ATOMIC epilogue after the dk/dv programs takes too.
    dq_grid, dq_bm, dq_warps = (num_blocks * nqt, h), bm, cfg["num_warps"]
    if not num_blocks:
        pass
    elif dq_atomic:
        if o_cache is not None:
            _cache_bwd_dq_oc_kernel[dq_grid](
                q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq,
                dgq_part, dsink_part, dgate_part, o_cache, h, nqt, scale, DELTA_ONLY=True, **common)
        else:
            _cache_bwd_delta_kernel[dq_grid](
                q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dsink_part,
                dgate_part, h, nqt, scale, **common)
        # The dk/dv programs add into it (zeros first); the epilogue after them reads it with the dq tiles.
        dqa = torch.zeros(num_tokens * h, d, dtype=torch.float32, device=device)
    elif o_cache is not None:
        _cache_bwd_dq_oc_kernel[dq_grid](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq,
            dgq_part, dsink_part, dgate_part, o_cache, h, nqt, scale, DELTA_ONLY=False, **common)
    elif prefix is None:
        dq_kernel = _cache_bwd_dq_two_pass_kernel if two_pass else _cache_bwd_dq_kernel
        dq_kernel[dq_grid](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq,
            dgq_part, dsink_part, dgate_part, h, nqt, scale, **common)
    else:
        _check_prefix(prefix, k, v)
        _cache_bwd_dq_pre_kernel[dq_grid](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, sink, gate, sel, blk_start, blk_len, dq,
            dgq_part, dsink_part, dgate_part, prefix.k, prefix.v, rka, prefix.start, prefix.length, h, nqt, scale,
            **common)
    dk = _empty(*k.shape, dtype=k.dtype, device=device)
    dv = _empty(*v.shape, dtype=v.dtype, device=device)
    cfg = dkdv_cfg
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    nct = triton.cdiv(window, bn)
    nkt = nct + triton.cdiv(block, bn)
    pdk, pdv, dgk_part, dest, num_slots, sentinel = _dkdv_partials(num_blocks, nkt, h, window, d, device)
    common = dict(W=window, D=d, BM=bm, BN=bn, DOT_PREC=prec, **cfg)
    if prefix is None:
        if num_blocks and dq_atomic:
            _cache_bwd_dkdv_dq_kernel[(num_blocks * nkt, h)](
                q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv,
                pdk, pdv, dgk_part, dest, sentinel, dqa, h, nkt, nct, scale, **common)
            _cache_bwd_dq_finish_kernel[dq_grid](dqa, q, rq, gamma_q, gamma_k, blk_start, blk_len, dq, dgq_part, h,
                                                 nqt, scale, D=d, BM=dq_bm, num_warps=dq_warps)
        elif num_blocks and not separate:
            _cache_bwd_dkdv_kernel[(num_blocks * nkt, h)](
                q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv,
                pdk, pdv, dgk_part, dest, sentinel, h, nkt, nct, scale, **common)
        elif num_blocks:
            for mode in (1, 2):  # dv, then dk
                _cache_bwd_dkdv_separate_kernel[(num_blocks * nkt, h)](
                    q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv,
                    pdk, pdv, dgk_part, dest, sentinel, h, nkt, nct, scale, MODE=mode, **common)
        _reduce_cache_partials(dest, pdk, pdv, dk, dv, num_slots, sentinel, d)
        # The gate's partials carry sigmoid'(gate) already.
        return dq, dk, dv, dgq_part.sum((0, 1)), dgk_part.sum((0, 1)), dsink_part.sum(0), dgate_part.sum(0)
    # The prefix rows that no block reads in-block (the cache's entries, unused buffer slots) get only the cache
    # reads' sums, added onto zeros; the in-block ones are written by their block first.
    dka = torch.zeros(prefix.k.shape, dtype=prefix.k.dtype, device=device)
    dva = torch.zeros(prefix.v.shape, dtype=prefix.v.dtype, device=device)
    a_base = num_tokens * h
    if num_blocks:
        _cache_bwd_dkdv_pre_kernel[(num_blocks * nkt, h)](
            q, k, v, do, lse, delta, rq, rk, gamma_q, gamma_k, gate, sel, blk_start, blk_len, dk, dv,
            pdk, pdv, dgk_part, dest, sentinel, prefix.k, prefix.v, rka, prefix.start, prefix.length, dka, dva, a_base,
            h, nkt, nct, scale, **common)
    if num_slots:
        dest_sorted, order = torch.sort(dest, stable=True)
        _scatter_cache_grads_pre_kernel[(num_slots,)](dest_sorted, order, pdk, pdv, dk, dv, dka, dva, num_slots,
                                                      sentinel, a_base, D=d, num_warps=1 if d <= 64 else 2)
    return (dq, dk, dv, dgq_part.sum((0, 1)), dgk_part.sum((0, 1)), dsink_part.sum(0), dgate_part.sum(0), dka,
            dva)
