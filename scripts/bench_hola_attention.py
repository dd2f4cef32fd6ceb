"""Benchmark one HOLA attention layer, forward + backward, against fla's GDN alone and causal SDPA attention.

At the 340M shapes by default: 4 heads x 256, 65,536 tokens per call, T = 2k, 8k, 32k, bf16. The tokens are one
packed row of 65,536 / T documents of T tokens (``cu_seqlens``, as the trainer feeds them with ``data.varlen``);
every fla and HOLA call uses that layout (one set of fla autotuning on a fresh machine instead of two).
Rows (medians of ``triton.testing.do_bench``, CUDA events):
- ``gdn_fla``: fla's public ``chunk_gated_delta_rule`` (in-kernel l2norm) alone;
- ``gdn_adapter``: this project's fla adapter (the same GDN plus the score), i.e. ``evict="none"``;
- ``hola_triton`` / ``hola_sdpa`` / ``hola_fa4``: ``hola_attention`` with each backend (window 64, block 256, evict
  score; ``fa4`` where ``pip install 'hola-titan[fa4]'`` made FlashAttention-4 importable on an sm_90 GPU, else
  the row records why not); ``hola_fa4_split``: the fa4 backend with its split layout (two calls merged by their
  log-sum-exps, only the cache entries gathered);
- ``hola_triton_overlap``: the Triton backend with ``overlap_backward=True`` (cache backward on a side stream);
- ``hola_triton_keep``: the Triton backend with ``save_cache_output=True`` (the backward forms delta from the
  kept cache-read output; its peak memory shows the extra tensor);
- ``hola_triton_tbwd`` / ``hola_triton_keep_tbwd``: the same two with the cache-read backward pinned to the Triton
  kernels (``triton_kernels.BACKWARD``), where the default runs the Gluon ones (sm_90, D 256);
  ``hola_triton_tall``: forward and backward pinned to the Triton kernels (``FORWARD`` too);
- ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)`` with 16 heads x 64;
- the forward stages of the Triton backend (state path + score, selection, cache attention) and the cache
  attention backward, to show where the time goes; with the fa4 backend available, the FlashAttention-4 varlen
  call alone forward and backward (``stage_fa4_*``, TFLOP/s by the same count) and what the adapter does around it
  (``stage_fa4_prep_ms``: layout, RMSNorms and the gather of the K/V slots).
Peak memory is the peak allocated during one forward + backward minus what was allocated before it.
``--sweep`` also times the cache-attention kernels under alternative launch configurations (T = 2k); with
``--keep-output`` the stage rows and the sweep time the kept-output forward and backward instead. Two
candidates of the cache read were measured against the Triton op and removed (docs/LOG.md, 2026-12-03):
FlexAttention (6x the time, 5x the memory) and FlashAttention-2's variable-length kernels with the work around
them compiled (1.24x the time, 2.75x the memory; the FlashAttention calls alone ran at 163 / 93 TFLOP/s).
The cache read's TFLOP/s count 4 D FLOPs per (query, key) pair it reads forward (``cache_pairs``: the filled
cache slots of each query's block and the block's tokens up to the query) and 2.5 times that backward.

Prints a table and writes JSON (``--out``). On Hopper with Triton < 3.7.1, fla's backward runs only after the
fla #640 gradient check of :mod:`hola_titan.kernels.gdn.fla_bridge` passes (its errors are recorded in the JSON).

    python scripts/bench_hola_attention.py --out outputs/bench_hola_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import os
import platform
import time

import torch
import torch.nn.functional as F


# The rows --items can name (main's ``items``, in this order).
ITEMS = ("gdn_fla", "gdn_adapter", "hola_triton", "hola_triton_overlap", "hola_triton_keep", "hola_triton_tbwd",
         "hola_triton_keep_tbwd", "hola_triton_tall", "hola_sdpa", "hola_fa4", "hola_fa4_split", "sdpa_causal")


def parse_args(argv=None):
    from hola_titan.kernels.runtime.tuned_configs import CHOICE_HELP
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/bench_hola_attention.json")
    p.add_argument("--tokens", type=int, default=65536, help="B * T per call")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--sweep", action="store_true", help="time alternative cache-kernel launch configurations")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep (first of --seq-lens)")
    p.add_argument("--sweep-match", default=None, metavar="REGEX", type=_regex,
                   help="with --sweep / --sweep-only: time only the configurations whose name matches (e.g. "
                        "'BN64_w8'); the configurations in use are always timed, as the rows to compare with")
    p.add_argument("--keep-output", action="store_true",
                   help="stage rows and sweep: the cache op keeping its output for the backward (save_cache_output)")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--rows", action="store_true", help="B rows of T tokens instead of one packed row")
    p.add_argument("--items", default=",".join(ITEMS),
                   help=f"comma-separated rows to time, of {', '.join(ITEMS)} (default: all)")
    p.add_argument("--kernel-configs", default="auto", help=CHOICE_HELP)
    p.add_argument("--profile", action="store_true",
                   help="also profile the GDN, Triton and fa4 rows (torch.profiler): GPU kernel time per "
                        "call by kernel, and the gap between the timed call and its kernels (host-bound time)")
    args = p.parse_args(argv)
    unknown = [name for name in _names(args.items) if name not in ITEMS]
    if unknown:
        p.error(f"--items: unknown {', '.join(unknown)}; expected some of {', '.join(ITEMS)}")
    return args


def bench(fn, grad_to_none, rep_ms):
    import triton
    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="median"))


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def make_inputs(b, t, h, d, device, dtype=torch.bfloat16, seed=0):
    from hola_titan.kernels.gdn.fla_bridge import hola_decay
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, device=device, generator=gen, dtype=dtype) for _ in range(3))
    g = hola_decay((b, t, h), device, generator=gen)
    beta = torch.sigmoid(torch.randn(b, t, h, device=device, generator=gen)).to(dtype)
    gamma_q = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(dtype)
    gamma_k = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(dtype)
    sink = torch.zeros(h, device=device, dtype=dtype)
    gate = torch.full((h,), -4.0, device=device, dtype=dtype)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, gamma_q, gamma_k, sink, gate)]
    return leaves


def main():
    args = parse_args()
    device = torch.device("cuda")
    from hola_titan import hola_attention
    from hola_titan.kernels.gdn import fla_bridge
    from hola_titan.kernels.hola import triton_kernels
    from hola_titan.kernels.hola.fa4 import fa4_problem
    from hola_titan.kernels.hola.stages import state_path
    from hola_titan.kernels.hola.triton_ops import cache_attn_bwd_op, cache_attn_op, select_topw_op
    from hola_titan.kernels.runtime.documents import Documents, build_block_table
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    import triton

    h, d, window, block = args.heads, args.dim, args.window, args.block
    meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                fla=fla_bridge.fla_version(), python=platform.python_version(), heads=h, dim=d, window=window,
                block=block, tokens=args.tokens, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    from hola_titan.kernels.runtime import tuned_configs
    installed = tuned_configs.install(args.kernel_configs, device)
    print("fla kernel configurations:", installed.describe(), flush=True)
    dp = fla_bridge.padded_head_dim(d, device)
    print(f"fla #640 gradient check at head dim {dp}", flush=True)
    t0 = time.time()
    fla_bridge.ensure_backward_checked(dp, device)
    meta["fla_640"] = dict(guard_applies=fla_bridge.guard_applies(device), head_dim=dp,
                           errors=fla_bridge._CHECKED.get((device.index or 0, dp)), seconds=round(time.time() - t0, 1))
    meta["cache_forward"] = triton_kernels.forward_kernels(d, torch.bfloat16, device)
    meta["cache_backward"] = triton_kernels.backward_kernels(d, torch.bfloat16, device)
    print("meta:", json.dumps(meta))

    def pinned_to_triton(fn, tables):
        """``fn`` with the cache read's kernels of ``tables`` (``FORWARD``, ``BACKWARD``) pinned to Triton."""
        def pinned(*a):
            saved = [table.get(d) for table in tables]
            for table in tables:
                table[d] = "triton"
            try:
                return fn(*a)
            finally:
                for table, value in zip(tables, saved):
                    if value is None:
                        del table[d]
                    else:
                        table[d] = value
        return pinned
    bwd_only = (triton_kernels.BACKWARD,)
    results = []
    for t in args.seq_lens:
        b = max(1, args.tokens // t)
        docs = b
        cu = documents = None
        if not args.rows:
            # As the trainer passes them: checked once from the host copy, so no timed call reads them back.
            host = torch.arange(0, b * t + 1, t, dtype=torch.int64)
            cu = host.to(device)
            documents = Documents.from_host(host, device=device, seq_len=b * t)
            b, t_row = 1, b * t
        else:
            t_row = t
        x = make_inputs(b, t_row, h, d, device)
        q, k, v, g, beta, gamma_q, gamma_k, sink, gate = x
        do = torch.randn(b, t_row, h, d, device=device, dtype=q.dtype)
        row = dict(T=t, B=docs, layout="rows" if args.rows else "packed")

        def gdn_fla():
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=d ** -0.5, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu)
            with fla_bridge.fla_backward_allowed(dp, device):
                o.backward(do)

        def hola(backend, evict="score", overlap_backward=False, keep=False):
            def fn():
                o, _ = hola_attention(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block,
                                      evict=evict, backend=backend, documents=documents,
                                      overlap_backward=overlap_backward, save_cache_output=keep)
                o.backward(do)
            return fn

        def hola_fa4_split():
            from hola_titan.kernels.hola.fa4 import hola_attention_fa4
            table = documents.block_table(block) if documents is not None else None
            o, _, _ = hola_attention_fa4(q, k, v, g, beta, gamma_q, gamma_k, sink, gate, window=window, block=block,
                                         evict="score", cu_seqlens=cu, block_table=table,
                                         chunk_indices=documents.chunk_indices if documents is not None else None,
                                         layout="split")
            o.backward(do)

        qa, ka, va = (torch.randn(docs, 16, t, 64, device=device, dtype=q.dtype, requires_grad=True) for _ in range(3))
        doa = torch.randn_like(qa)

        def sdpa_causal():
            F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(doa)

        items = {"gdn_fla": (gdn_fla, x[:5]), "gdn_adapter": (hola("triton", "none"), x[:5]),
                 "hola_triton": (hola("triton"), x), "hola_triton_overlap": (hola("triton", overlap_backward=True), x),
                 "hola_triton_keep": (hola("triton", keep=True), x),
                 "hola_triton_tbwd": (pinned_to_triton(hola("triton"), bwd_only), x),
                 "hola_triton_keep_tbwd": (pinned_to_triton(hola("triton", keep=True), bwd_only), x),
                 "hola_triton_tall": (pinned_to_triton(hola("triton"), (triton_kernels.FORWARD,
                                                                       triton_kernels.BACKWARD)), x),
                 "hola_sdpa": (hola("sdpa"), x), "hola_fa4": (hola("fa4"), x), "hola_fa4_split": (hola_fa4_split, x),
                 "sdpa_causal": (sdpa_causal, [qa, ka, va])}
        assert tuple(items) == ITEMS, "ITEMS must list main's rows"
        wanted = set(_names(args.items))
        items = {k: val for k, val in items.items() if k in wanted}
        if args.sweep_only:
            items = {}
        for name, (fn, grads) in items.items():
            try:
                fn()  # compile / autotune outside the timing
                row[name + "_ms"] = bench(fn, grads, args.rep_ms)
                for p in grads:
                    p.grad = None
                row[name + "_peak_mib"] = peak_mib(fn)
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for p in grads:
                p.grad = None
        # Stages of the Triton backend's forward, and the cache attention backward.
        with torch.no_grad():
            table = build_block_table(b, t_row, cu, block, device)
            chunks = documents.chunk_indices if documents is not None else None
            o_state, m, _ = state_path(q, k, v, g, beta, initial_state=None, cu_seqlens=cu, output_final_state=False,
                                       chunk_indices=chunks)
            m_flat = m.reshape(b * t_row, h)
            row["stage_state_fwd_ms"] = bench(lambda: state_path(q, k, v, g, beta, initial_state=None, cu_seqlens=cu,
                                                                 output_final_state=False, chunk_indices=chunks),
                                              None, args.rep_ms)

            def sel_fn():
                return select_topw_op(m_flat, table.blk_start, table.blk_len, table.doc_first_blk, table.doc_num_blk,
                                      block, window)
            sel, _ = sel_fn()
            row["stage_select_ms"] = bench(sel_fn, None, args.rep_ms)
            row["stage_cache_keep_output"] = args.keep_output

            def fwd_fn():
                return cache_attn_op(q, k, v, o_state, gamma_q, gamma_k, sink, gate, sel, table.blk_start,
                                     table.blk_len, block, window, args.keep_output)
            out = fwd_fn()
            row["stage_cache_fwd_ms"] = bench(fwd_fn, None, args.rep_ms)
            row["stage_cache_fwd_kernels"] = triton_kernels.forward_kernels(d, q.dtype, device)[0]
            if row["stage_cache_fwd_kernels"] != "triton":
                triton_fwd_fn = pinned_to_triton(fwd_fn, (triton_kernels.FORWARD,))
                triton_fwd_fn()
                row["stage_cache_fwd_triton_ms"] = bench(triton_fwd_fn, None, args.rep_ms)

            def bwd_fn():
                return cache_attn_bwd_op(do, q, k, v, out[1], out[2], out[3], gamma_q, gamma_k, sink, gate, sel,
                                         table.blk_start, table.blk_len, block, window,
                                         out[4] if args.keep_output else None)
            bwd_fn()
            row["stage_cache_bwd_ms"] = bench(bwd_fn, None, args.rep_ms)
            row["stage_cache_bwd_kernels"] = triton_kernels.backward_kernels(d, q.dtype, device)[0]
            if row["stage_cache_bwd_kernels"] != "triton":
                triton_bwd_fn = pinned_to_triton(bwd_fn, bwd_only)
                triton_bwd_fn()
                row["stage_cache_bwd_triton_ms"] = bench(triton_bwd_fn, None, args.rep_ms)
            # The read's FLOPs: 4 D per (query, key) pair read forward (q k^T and p v), 2.5 times that backward
            # (FlashAttention's convention: five products against two; the dq pass's sum of p kc is not counted).
            pairs = cache_pairs(sel, table)
            row["cache_pairs"] = pairs
            row["stage_cache_fwd_tflops"] = 4 * d * pairs / (row["stage_cache_fwd_ms"] * 1e9)
            if "stage_cache_fwd_triton_ms" in row:
                row["stage_cache_fwd_triton_tflops"] = 4 * d * pairs / (row["stage_cache_fwd_triton_ms"] * 1e9)
            row["stage_cache_bwd_tflops"] = 10 * d * pairs / (row["stage_cache_bwd_ms"] * 1e9)
            if "stage_cache_bwd_triton_ms" in row:
                row["stage_cache_bwd_triton_tflops"] = 10 * d * pairs / (row["stage_cache_bwd_triton_ms"] * 1e9)
            row.update(gather_stages(k, sel, table, block, window, args.rep_ms))
            fa4_why = fa4_problem(device, head_dim=d, dtype=q.dtype)
            row["stage_fa4"] = fa4_why or "available"
            if fa4_why is None:
                row.update(fa4_stages(q, k, v, gamma_q, gamma_k, sink, sel, table, do, block, window, pairs,
                                      args.rep_ms))
            if (args.sweep or args.sweep_only) and t == args.seq_lens[0]:
                # The sweep's launch tables are the Triton kernels': both directions pinned to them.
                row["sweep"] = sweep(triton_kernels, pinned_to_triton(fwd_fn, (triton_kernels.FORWARD,)),
                                     pinned_to_triton(bwd_fn, bwd_only), d, args.rep_ms,
                                     match=args.sweep_match, kept=args.keep_output)
        if args.profile:
            profiled = ("gdn_fla", "gdn_adapter", "hola_triton", "hola_triton_overlap", "hola_triton_keep",
                        "hola_triton_tbwd", "hola_fa4", "hola_fa4_split")
            # Only the rows that ran here (a fa4 row where FlashAttention-4 cannot run holds only its reason).
            row["profile"] = {name: profile(fn, grads, row.get(name + "_ms"))
                              for name, (fn, grads) in items.items() if name in profiled and name + "_ms" in row}
        if "gdn_fla_ms" in row:
            for name in ("hola_triton", "hola_triton_overlap", "hola_triton_keep", "hola_triton_tbwd",
                         "hola_triton_keep_tbwd", "hola_triton_tall", "hola_sdpa", "hola_fa4", "hola_fa4_split",
                         "gdn_adapter"):
                if name + "_ms" in row:
                    row[name + "_over_gdn"] = row[name + "_ms"] / row["gdn_fla_ms"]
                    row[name + "_mem_over_gdn"] = row[name + "_peak_mib"] / row["gdn_fla_peak_mib"]
        if "sdpa_causal_ms" in row and "hola_triton_ms" in row:
            row["hola_triton_over_sdpa_causal"] = row["hola_triton_ms"] / row["sdpa_causal_ms"]
        results.append(row)
        print("row:", json.dumps(row), flush=True)
        if args.sweep_only:
            break
        x = q = k = v = g = beta = do = qa = ka = va = doa = None  # free this T before the next
        torch.cuda.empty_cache()
    meta["kernel_configs"] = installed.record()  # what was served (or autotuned) over the whole run
    report = dict(meta=meta, results=results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(results)


def _regex(text):
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression: {error}") from None


def _names(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def profile(fn, grads, timed_ms, iters=5, top=12):
    """GPU kernel time per call, by kernel name, against the call's timed median (``hola_titan/profiling.py``)."""
    from hola_titan.profiling import kernel_profile

    def call():
        fn()
        for p in grads:
            p.grad = None

    call()
    return kernel_profile(call, device=torch.device("cuda"), timed_ms=timed_ms, iters=iters, top=top)


def sweep(attn_mod, fwd_fn, bwd_fn, d, rep_ms, match=None, kept=False):
    """Time the cache kernels under alternative configurations (each kernel kind swept on its own); ``match``: a
    regular expression the configuration's name must match (the one in use is timed whatever it is); ``kept``: the
    functions keep the forward's output, whose backward takes its dk/dv launch from ``CONFIGS["dkdv_kept"]``."""
    split, two, sep, atomic = dict(SPLIT=2), dict(TWO_PASS=True), dict(SEPARATE=True), dict(DQ_ATOMIC=True)
    # (BM, BN, warps, stages[, variant]): the variants (hola_titan/kernels/hola/triton_kernels.py, VARIANTS) trade more
    # products for one half-sized or one fewer [BM, D] accumulator, i.e. fewer registers at D = 256. Compiled here for
    # sm_90a with Triton 3.6 (scripts/kernel_resources.py, docs/LOG.md 2026-12-03): the current tiles spill (forward 72
    # bytes of stack, dq 200, dk/dv 160; dq and dk/dv use no wgmma at 32-row tiles); split forward 64x32 w4, two-pass dq
    # 32x64 w8 and separate dk/dv 32x32 and 32x64 w8 (the latter with wgmma) spill nothing. Added after the Nsight
    # Compute profile (the backward bound by shared-memory traffic of mma.sync, LOG 2026-12-03): 64-key tiles at 8
    # warps, where dk/dv gets wgmma (16x64: 112 bytes of stack, 32x64: 160) and dq wider key tiles (16x64: 208
    # registers, no spills). DQ_ATOMIC (dq summed by the dk/dv programs, 7 products per pair instead of 8; its delta
    # pass and epilogue take the dq tiles in use), compiled the same way (LOG 2026-12-03): its dk/dv kernel at 32x32 w4
    # 255 registers and 200 bytes of stack (160 without the dq sums), at 32x32 w8 246 and none, at 64x32 w8 32 bytes;
    # the delta pass at 32x32 w4 161 registers.
    grid = {
        "fwd": [(64, 32, 4, 2), (64, 32, 4, 1), (64, 32, 4, 3), (64, 64, 4, 2), (64, 16, 4, 2), (128, 32, 8, 2),
                (128, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2, split), (64, 64, 4, 2, split),
                (128, 32, 8, 2, split), (128, 64, 8, 2, split), (64, 64, 4, 3, split)],
        "dq": [(32, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 3), (32, 32, 8, 2), (16, 32, 4, 2), (32, 64, 4, 2),
               (64, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2, two), (64, 32, 4, 2, two), (64, 64, 4, 2, two),
               (64, 32, 8, 2, two), (128, 32, 8, 2, two), (32, 32, 8, 2, two), (32, 64, 8, 2, two),
               (32, 64, 8, 2), (16, 64, 8, 2), (16, 64, 8, 3)],
        "dkdv": [(32, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 3), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 8, 2),
                 (64, 64, 8, 2), (32, 32, 4, 2, sep), (32, 32, 8, 2, sep), (32, 64, 8, 2, sep), (64, 32, 8, 2, sep),
                 (64, 64, 8, 2, sep), (32, 64, 8, 2), (16, 64, 8, 2), (16, 64, 8, 3), (32, 32, 4, 2, atomic),
                 (32, 32, 8, 2, atomic), (64, 32, 8, 2, atomic), (32, 64, 8, 2, atomic)],
    }
    out = {}
    for kind, configs in grid.items():
        table = attn_mod.CONFIGS["dkdv_kept" if kind == "dkdv" and kept else kind]
        saved = dict(table[d])
        # The configuration in use first, whether or not the grid names it: the row the others compare with.
        in_use_entry = (saved["BM"], saved["BN"], saved["num_warps"], saved["num_stages"],
                        {k: v for k, v in saved.items() if k not in ("BM", "BN", "num_warps", "num_stages")})
        configs = [in_use_entry] + [c for c in configs if tuple(c[:4]) + ((c[4] if len(c) > 4 else {}),)
                                    != in_use_entry]
        for i, (bm, bn, nw, ns, *variant) in enumerate(configs):
            extra = variant[0] if variant else {}
            table[d] = dict(BM=bm, BN=bn, num_warps=nw, num_stages=ns, **extra)
            key = f"{kind}_BM{bm}_BN{bn}_w{nw}_s{ns}" + "".join(f"_{name}{value}" for name, value in extra.items())
            if match is not None and i > 0 and not match.search(key):  # the first is the one in use
                continue
            if kept and i > 0 and extra.get("TWO_PASS"):  # a kept output's dq pass has no second pass: the same kernels
                continue
            try:
                fn = fwd_fn if kind == "fwd" else bwd_fn
                fn()
                out[key] = bench(fn, None, rep_ms)
            except Exception as e:  # noqa: BLE001
                out[key] = f"{type(e).__name__}: {str(e)[:120]}"
            print("sweep:", key, out[key], flush=True)
        table[d] = saved
    return out


def fa4_stages(q, k, v, gamma_q, gamma_k, sink, sel, table, do, block, window, pairs, rep_ms) -> dict:
    """The fa4 backend's read in parts: the FlashAttention-4 call forward and backward alone, and what the adapter
    does around it (layout, RMSNorms, the gathered K/V slots)."""
    from hola_titan.kernels.hola.fa4 import fa4_varlen_bwd_op, fa4_varlen_op, read_rows, varlen_layout
    from hola_titan.kernels.hola.stages import gather_head_rows

    b, t, h, d = q.shape
    n = b * t

    def prep():  # what the backend's gathered layout does before its call
        lay = varlen_layout(sel, table, num_tokens=n, window=window, block=block)
        qc, kc, vr = read_rows(q, k, v, gamma_q, gamma_k)
        return lay, qc, gather_head_rows(kc, lay.key_rows), gather_head_rows(vr, lay.key_rows)

    lay, qc, ks, vs = prep()
    args = (qc, ks, vs, sink.float(), lay.cu_q, lay.cu_k, lay.used_k, lay.max_q, lay.max_k, d ** -0.5, True)
    out, lse = fa4_varlen_op(*args)
    dout = do.reshape(n, h, d)
    row = {"stage_fa4_prep_ms": bench(prep, None, rep_ms), "stage_fa4_fwd_ms": bench(lambda: fa4_varlen_op(*args),
                                                                                    None, rep_ms)}
    row["stage_fa4_bwd_ms"] = bench(lambda: fa4_varlen_bwd_op(dout, None, qc, ks, vs, out, lse, *args[3:], False),
                                    None, rep_ms)
    row["stage_fa4_fwd_tflops"] = 4 * d * pairs / (row["stage_fa4_fwd_ms"] * 1e9)
    row["stage_fa4_bwd_tflops"] = 10 * d * pairs / (row["stage_fa4_bwd_ms"] * 1e9)
    return row


def gather_stages(k, sel, table, block, window, rep_ms) -> dict:
    """The SDPA and FA4 backends' gather of token rows into key slots per head (the FA4 gathered layout's slots of
    one of K or V), forward and backward: ``gather_head_rows`` as the backends run it, and the advanced indexing over
    an appended zero row they used before 2026-12-07, whose backward sums all empty slots into that row one by
    one. Their gap should grow with the number of documents (each document's first block has W empty slots)."""
    from hola_titan.kernels.hola.fa4 import varlen_layout
    from hola_titan.kernels.hola.stages import gather_head_rows

    b, t, h, d = k.shape
    n = b * t
    lay = varlen_layout(sel, table, num_tokens=n, window=window, block=block)
    rows = k.detach().reshape(n, h, d).clone().requires_grad_()
    heads = torch.arange(h, device=k.device)
    dout = torch.randn(lay.key_rows.shape[0], h, d, device=k.device, dtype=k.dtype)

    def new():
        gather_head_rows(rows, lay.key_rows).backward(dout)

    def old():
        torch.cat([rows, rows.new_zeros(1, h, d)])[lay.key_rows, heads[None, :]].backward(dout)

    empty = int((lay.key_rows == n).sum())
    return {"stage_gather_ms": bench(new, [rows], rep_ms), "stage_gather_indexing_ms": bench(old, [rows], rep_ms),
            "stage_gather_empty_slots": empty}


def cache_pairs(sel, table) -> int:
    """(query, key) pairs the cache read computes: every query of a block reads the block's filled cache slots (per
    head) and the block's tokens up to itself."""
    blk_len = table.blk_len.long()
    heads = sel.shape[1]
    filled = (sel >= 0).sum(-1).long()  # [NB, H]
    return int((filled * blk_len[:, None]).sum() + heads * (blk_len * (blk_len + 1) // 2).sum())


def print_table(results):
    cols = [("T", "T"), ("B", "B"), ("gdn_fla_ms", "GDN ms"), ("gdn_adapter_ms", "adapter ms"),
            ("hola_triton_ms", "HOLA triton ms"), ("hola_triton_overlap_ms", "overlap ms"),
            ("hola_triton_keep_ms", "keep ms"), ("hola_triton_keep_mem_over_gdn", "mem keep/GDN"),
            ("hola_triton_tbwd_ms", "triton bwd ms"), ("hola_triton_keep_tbwd_ms", "keep triton bwd ms"),
            ("hola_triton_tall_ms", "triton fwd+bwd ms"),
            ("hola_sdpa_ms", "HOLA sdpa ms"), ("hola_fa4_ms", "HOLA fa4 ms"), ("hola_fa4_over_gdn", "fa4/GDN"),
            ("hola_fa4_split_ms", "fa4 split ms"), ("hola_fa4_split_over_gdn", "fa4 split/GDN"),
            ("sdpa_causal_ms", "SDPA causal ms"),
            ("hola_triton_over_gdn", "triton/GDN"), ("hola_sdpa_over_gdn", "sdpa/GDN"),
            ("hola_triton_over_sdpa_causal", "triton/SDPA"), ("hola_triton_mem_over_gdn", "mem triton/GDN"),
            ("stage_state_fwd_ms", "state fwd"), ("stage_select_ms", "select"), ("stage_cache_fwd_ms", "cache fwd"),
            ("stage_cache_fwd_triton_ms", "cache fwd triton"),
            ("stage_cache_bwd_ms", "cache bwd"), ("stage_cache_bwd_triton_ms", "cache bwd triton"),
            ("stage_cache_fwd_tflops", "fwd TFLOP/s"), ("stage_cache_bwd_tflops", "bwd TFLOP/s"),
            ("stage_fa4_fwd_tflops", "fa4 fwd TFLOP/s"), ("stage_fa4_bwd_tflops", "fa4 bwd TFLOP/s"),
            ("stage_fa4_prep_ms", "fa4 prep ms"),
            ("stage_gather_ms", "gather f+b ms"), ("stage_gather_indexing_ms", "old indexing f+b ms"),
            ("hola_triton_tbwd_over_gdn", "triton bwd/GDN"), ("hola_triton_tall_over_gdn", "triton all/GDN")]
    print(" | ".join(c[1] for c in cols))
    for r in results:
        cells = []
        for key, _ in cols:
            val = r.get(key, r.get(key.replace("_ms", "_error"), "-"))
            cells.append(f"{val:.3f}" if isinstance(val, float) and not math.isnan(val) else str(val)[:40])
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
