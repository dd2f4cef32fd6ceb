"""A stack of HOLA token mixers under context parallelism: forward + backward time, bytes received, peak memory.

Every rank draws the same whole row (one document of T tokens, or ``--docs`` equal documents), keeps its shard
and runs ``--layers`` token mixers one after another (layer l+1's queries are q + layer l's output, so each layer
needs the one before, as in a model) through ``CPLayer.attention`` (the state and cache handed along the ranks,
``hola_titan.parallelisms.context_parallel``), forward and backward: across layers the ranks pipeline. Rank 0
then runs the same stack through ``hola_attention`` on the whole row alone, the one-GPU baseline (reported as out
of memory where it does not fit). Rows (medians over ``--reps`` calls, CUDA events):

- ``cp_ms`` / ``single_ms``: forward + backward of the stack, CP against one GPU, and ``speedup`` = single / cp;
- ``comm_bytes_per_rank``: bytes each rank received in forward messages (per stack; rank 0 receives none);
- ``cp_peak_gib`` / ``single_peak_gib``: peak allocated memory of one forward + backward.

A whole model adds the MLPs and projections, which CP splits perfectly; ``scripts/composition_run.py --mode
gpu2`` measures the model. Shapes default to the 340M layer (4 heads x 256, window 64, block 256, bf16).

    torchrun --nproc_per_node 2 scripts/bench_context_parallel.py --seq-lens 32768 65536 131072 --out cp.json
    torchrun --nproc_per_node 2 scripts/bench_context_parallel.py --device cpu --seq-lens 64 --block 8 \\
        --window 4 --heads 2 --dim 16 --reps 1 --out /tmp/cp.json     # a smoke test (gloo, reference backend)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    from hola_titan.kernels.runtime.tuned_configs import CHOICE_HELP
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--docs", type=int, default=1, help="equal documents per row")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--evict", default="score", choices=("score", "recency", "none"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=24, help="token mixers in the stack (the 340M model has 24)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--profile", action="store_true",
                   help="also profile the CP call and the single call (hola_titan/profiling.py): kernel time "
                        "against wall time, top kernels, ATen calls per call; with --predict the fresh and the "
                        "continuing token mixer")
    p.add_argument("--kernel-configs", default="auto", help=CHOICE_HELP)
    p.add_argument("--out", type=Path, default=Path("bench_context_parallel.json"))
    p.add_argument("--predict", action="store_true",
                   help="one process: time each stage of a 340M shard (layer fresh / continuing, head, optimizer) at "
                        "each --seq-lens (tokens per rank) and predict the pipelined protocol's step at --ranks "
                        "(hola_titan/parallelisms/critical_path.py); rows are appended to --prediction-out")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--size", default="340M")
    p.add_argument("--p2p-gbps", type=float, default=100.0,
                   help="assumed point-to-point bandwidth of a layer's message, GB/s (prediction)")
    p.add_argument("--allreduce-gbps", type=float, default=100.0,
                   help="assumed all-reduce bus bandwidth of the gradients, GB/s (prediction)")
    p.add_argument("--latency-us", type=float, default=20.0, help="assumed latency per message (prediction)")
    p.add_argument("--prediction-out", type=Path, default=Path("docs/results/cp_prediction.json"))
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="with --predict: the device memory for the activation-checkpointing estimate (default: "
                        "the CUDA device's; none on a CPU)")
    p.add_argument("--stages-json", type=Path, default=None,
                   help="with --predict: read the stage timings from an earlier run's --out JSON instead of timing")
    return p.parse_args(argv)


def inputs(t, args, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, d = args.heads, args.dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x = {"q": randn(1, t, h, d), "k": randn(1, t, h, d), "v": randn(1, t, h, d),
         "g": -torch.nn.functional.softplus(randn(1, t, h)) * 0.1, "beta": torch.sigmoid(randn(1, t, h)),
         "gamma_q": 1 + 0.1 * randn(d), "gamma_k": 1 + 0.1 * randn(d), "sink": randn(h), "gate": randn(h) - 4}
    out = {n: (x[n].to(dtype) if n in ("q", "k", "v", "gamma_q", "gamma_k", "sink", "gate") else x[n])
           for n in x}
    return out, randn(1, t, h, d).to(dtype)


NAMES = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")


def boundary_cache(n: int, h: int, d: int, *, window: int, block: int, evict: str, dtype: torch.dtype,
                   device: torch.device):
    """``(cache, seen)``: ``n`` sequences' caches as a shard boundary inside a block leaves them (persistent
    entries full, the block half buffered), their k and v leaves that take gradients; ``seen`` tokens each."""
    from hola_titan.kernels.hola.cache import HolaCache

    empty = HolaCache.empty(n, h, d, window=window, block=block, evict=evict, dtype=dtype, device=device)
    seen, half = 4 * block + block // 2, block // 2
    cache = HolaCache(scores=torch.rand(n, h, window, device=device),
                      positions=torch.arange(window, device=device).repeat(n, h, 1),
                      k=torch.randn_like(empty.k).requires_grad_(), v=torch.randn_like(empty.v).requires_grad_(),
                      buf_scores=torch.cat([torch.rand(n, h, half, device=device),
                                            torch.full((n, h, block - half), float("-inf"), device=device)], -1),
                      buf_k=torch.randn_like(empty.buf_k).requires_grad_(),
                      buf_v=torch.randn_like(empty.buf_v).requires_grad_(),
                      seen=torch.full((n,), seen, device=device, dtype=torch.int64), window=window, block=block,
                      evict=evict)
    return cache, seen


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn, reps):
        """Median milliseconds of ``reps`` calls (one untimed call first), and the peak GiB of one call."""
        cuda = self.device.type == "cuda"
        fn()
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        peak = None  # CPU: not measured
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2 ** 30
        return sorted(times)[len(times) // 2], peak

    def back_to_back(self, fn, reps):
        """Mean milliseconds per call of ``reps`` calls issued back to back (one untimed call first): the host
        queues each call while the GPU runs the one before, as the layers of a training step run, so a call's
        host work before its first kernel (which a synchronised call exposes) overlaps GPU work."""
        fn()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return 1e3 * (time.perf_counter() - t0) / reps
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps


def count_host_syncs(fn, device) -> int | None:
    """How many times one call of ``fn`` made the host wait for the GPU (CUDA's sync debug mode), None on CPU.
    Each wait leaves the GPU idle while the host issues what comes next."""
    if device.type != "cuda":
        return None
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _cell(row: dict, key: str, fmt: str) -> str:
    val = row.get(key)
    if val is None or (isinstance(val, float) and math.isnan(val)):
        return "-"
    return fmt.format(val) if isinstance(val, (int, float)) else str(val)


def stage_timings(args, device, t: int) -> dict:
    """Milliseconds of one shard of ``t`` tokens of the ``--size`` HOLA model on one device: a block forward and
    backward starting its document (rank 0) and continuing one from an incoming state and cache whose gradients
    it returns (later ranks), the head with its loss, and a fused AdamW step over the whole model's parameters;
    plus the bytes of one layer's message and each block's peak memory."""
    from hola_titan.loss import chunked_linear_cross_entropy
    from hola_titan.models.args import model_args, replace
    from hola_titan.models.context import NO_CONTEXT
    from hola_titan.models.model import TransformerBlock, build_model
    from hola_titan.ops import hola_attention, resolve_kernels

    margs = model_args("hola", args.size, vocab_size=32000)
    h, d, dim = margs.n_heads, margs.head_dim, margs.dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    torch.manual_seed(0)
    kernels = resolve_kernels("auto", device)
    with torch.device("meta"):
        block = TransformerBlock(margs, backend="auto", kernels=kernels)
    block.to_empty(device=device)
    block.init_weights(0.02, 0.02 / math.sqrt(2 * margs.n_layers))
    block.to(dtype)
    x = torch.randn(1, t, dim, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, t, dim, device=device, dtype=dtype)
    out: dict = {}
    saved = {}

    def block_fwd():
        saved["y"] = block(x, context=NO_CONTEXT, positions=None, cache=None)

    def block_bwd():
        saved["y"].backward(dy)
        x.grad = None
        block.zero_grad(set_to_none=True)

    def block_both():
        block_fwd()
        block_bwd()

    out["layer_fwd_fresh"], _ = timer(block_fwd, args.reps)
    out["layer_fwd_bwd_fresh"], out["layer_peak_gib"] = timer(block_both, args.reps)
    out["layer_bwd_fresh"] = out["layer_fwd_bwd_fresh"] - out["layer_fwd_fresh"]
    saved.clear()

    # The token mixer alone, fresh and continuing (state and cache with gradients), on the same inputs: a continuing
    # layer is the fresh layer with the mixer's difference.
    mix, do = inputs(t, argparse.Namespace(heads=h, dim=d), device, dtype)
    kw = dict(window=margs.window, block=margs.block, evict=margs.evict)
    full = {n: mix[n].requires_grad_() for n in NAMES}
    state = (0.01 * torch.randn(1, h, d, d, device=device)).requires_grad_()
    cache, seen = boundary_cache(1, h, d, window=margs.window, block=margs.block, evict=margs.evict, dtype=dtype,
                                 device=device)
    leaves = [state, cache.k, cache.v, cache.buf_k, cache.buf_v]
    # As a context-parallel batch does: the continuing call's index layout made once, for every layer.
    from hola_titan.kernels.hola.continuation import ContinuationLayout
    continuation = ContinuationLayout.from_host([seen], None, batch=1, seq_len=t, window=margs.window,
                                                block=margs.block, device=device)

    def mixer(initial: bool):
        def run():
            extra = dict(initial_state=state, initial_cache=cache, continuation=continuation) if initial else {}
            o, _ = hola_attention(*(full[n] for n in NAMES), **kw, **extra)
            o.backward(do)
            for tensor in [*full.values(), *leaves]:
                tensor.grad = None
        return run

    out["mixer_fresh"], _ = timer(mixer(False), args.reps)
    try:
        out["mixer_cont"], _ = timer(mixer(True), args.reps)
        out["mixer_cont_note"] = "measured with gradients to the incoming state and cache"
    except Exception as exc:  # reported: the continuing call's backward is what the protocol needs
        out["mixer_cont_error"] = f"{type(exc).__name__}: {exc}"
        out["mixer_cont"] = float("nan")
    # The same two calls issued back to back. A continuing call makes more host work than a fresh one (its prefix
    # and index space: 566 ATen calls against 262), which a synchronised call pays before its first kernel and a
    # step of 24 layers overlaps with the layer before: what a continuing layer adds to a step is the back-to-back
    # difference (H200, 64k, 2026-12-03, docs/LOG.md: synchronised +0.14 to +1.8 ms over runs, back to back +0.24 to
    # +0.55 ms; the host 7-10 ms per continuing call, 6-7.5 per fresh one, against 16 ms of GPU work).
    out["mixer_fresh_b2b"] = timer.back_to_back(mixer(False), args.reps)
    out["mixer_cont_b2b"] = (timer.back_to_back(mixer(True), args.reps) if "mixer_cont_error" not in out
                             else float("nan"))
    # The state path alone (the GDN recurrence and the score, fla's kernels on a GPU), fresh and from an incoming
    # state with its gradient: how much of the continuing mixer's extra time is the state path's own (fla's
    # state-gradient kernel took 5.1 ms against 4.0 at 64k on an H200 with its initial-state store, 2026-12-03;
    # hola_titan/kernels/gdn/fla_bridge.py now launches it without that store).
    from hola_titan.kernels.hola.stages import state_path

    def state_only(initial: bool):
        def run():
            o_state, m, _ = state_path(*(full[n] for n in ("q", "k", "v", "g", "beta")),
                                       initial_state=state if initial else None, cu_seqlens=None,
                                       output_final_state=False, recompute_norms=not initial)
            (o_state * do).sum().add(m.sum()).backward()
            for tensor in [*full.values(), state]:
                tensor.grad = None
        return run

    out["state_fresh"], _ = timer(state_only(False), args.reps)
    out["state_cont"], _ = timer(state_only(True), args.reps)
    out["state_cont_note"] = ("the state path from an incoming state with its gradient, norms kept as a continuing "
                              "call keeps them; fresh: remade in backward, as a fresh call does")
    if args.profile and device.type == "cuda":
        # Where a continuing mixer's extra time goes: kernels by name and kind, ATen calls, host-bound gap; the mixer's
        # and the state path's alone.
        from hola_titan.profiling import kernel_profile
        for name, make in (("mixer", mixer), ("state", state_only)):
            for suffix, initial in (("_fresh", False), ("_cont", True)):
                if not math.isnan(out[name + suffix]):
                    out["profile_" + name + suffix] = kernel_profile(make(initial), device=device,
                                                                     timed_ms=out[name + suffix], iters=3,
                                                                     label=name + suffix, keep=40)
    # Split the continuing mixer's extra time (back to back, see above) between forward and backward as the fresh
    # layer splits.
    extra = out["mixer_cont_b2b"] - out["mixer_fresh_b2b"]
    out["mixer_extra_from"] = "back to back"
    share = out["layer_fwd_fresh"] / out["layer_fwd_bwd_fresh"]
    out["layer_fwd_cont"] = out["layer_fwd_fresh"] + share * extra
    out["layer_bwd_cont"] = out["layer_bwd_fresh"] + (1 - share) * extra
    full = mix = do = block = x = dy = None  # free them before the head

    # Head: embedding, final norm and the chunked loss over the tied head, forward and backward.
    model = build_model(replace(margs, n_layers=1), device=device).to(dtype)  # its block is not run
    tokens = torch.randint(0, 32000, (1, t), device=device)

    def head():
        hidden = model.norm(model.tok_embeddings(tokens).reshape(t, -1))
        loss = chunked_linear_cross_entropy(hidden, model.output_weight(), tokens.reshape(-1),
                                            matmul_dtype=dtype, kernel=kernels == "triton")
        loss.backward()
        model.zero_grad(set_to_none=True)

    out["head"], out["head_peak_gib"] = timer(head, args.reps)
    model = None
    # The optimizer over the whole model's parameters (fused AdamW on fp32 master weights, as the trainer runs).
    whole = build_model(margs, device=device)
    params = [p for p in whole.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    out["optimizer"], _ = timer(opt.step, args.reps)
    out["param_bytes_fp32"] = sum(p.numel() * 4 for p in params)
    del whole, params, opt
    out["message_bytes"] = sum(_message_sizes(margs))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _message_sizes(margs) -> tuple[int, int]:
    """Bytes of one layer's two messages across a boundary (floats in fp32, the compute dtype of bf16 training;
    integers), for one crossing document of one row (``context_parallel.message_bytes``)."""
    from hola_titan.parallelisms.context_parallel import message_bytes
    return message_bytes(rows=1, conv_size=margs.conv_size, heads=margs.n_heads, head_dim=margs.head_dim,
                         window=margs.window, block=margs.block, evict=margs.evict, crossing=1)


def predict(args, device) -> int:
    """``--predict``: stage timings at each length, then the pipelined protocol's step at each R."""
    from datetime import date

    from hola_titan.models.args import model_args
    from hola_titan.parallelisms.critical_path import (Stages, allreduce_ms, message_ms, one_gpu_step_ms,
                                                       pipelined_step_ms)

    margs = model_args("hola", args.size, vocab_size=32000)
    n = margs.n_layers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows, timings = [], {}
    measured = date.today().isoformat()  # the date of the stage timings the rows come from
    if args.stages_json is not None:
        earlier = json.loads(args.stages_json.read_text())
        name, timings = earlier["device"], {int(k): v for k, v in earlier["timings"].items()}
        measured = earlier.get("date", measured)
        args.seq_lens = sorted(timings)
    for t in args.seq_lens:
        if t not in timings:
            timings[t] = stage_timings(args, device, t)
        st = timings[t]
        print(f"stages T={t}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in st.items() if not k.startswith("profile_")), flush=True)
    for t in args.seq_lens:
        st = timings[t]
        twice = timings.get(2 * t)
        linear = None
        if twice is not None:
            linear = (twice["layer_fwd_bwd_fresh"] / st["layer_fwd_bwd_fresh"]) / 2
        for big_r in args.ranks:
            stages = Stages(layer_fwd_fresh=st["layer_fwd_fresh"], layer_bwd_fresh=st["layer_bwd_fresh"],
                            layer_fwd_cont=st["layer_fwd_cont"], layer_bwd_cont=st["layer_bwd_cont"],
                            head=st["head"], optimizer=st["optimizer"],
                            message=sum(message_ms(size, bandwidth_gbps=args.p2p_gbps, latency_us=args.latency_us)
                                        for size in _message_sizes(margs) if size),
                            allreduce=allreduce_ms(st["param_bytes_fp32"], ranks=big_r,
                                                   bandwidth_gbps=args.allreduce_gbps, latency_us=args.latency_us))
            cp_ms = pipelined_step_ms(stages, num_layers=n, ranks=big_r)
            one_ms = one_gpu_step_ms(stages, num_layers=n, ranks=big_r)
            one_from = f"{big_r} x the work at T"
            whole = timings.get(big_r * t)
            if whole is not None:  # one GPU's stages measured at R x T: use them, not the linear scaling
                one_ms = n * whole["layer_fwd_bwd_fresh"] + whole["head"] + whole["optimizer"]
                one_from = "measured at R x T"
            # What a continuation as fast as a fresh start would give (the lever the prediction points at).
            as_fresh = dataclasses.replace(stages, layer_fwd_cont=stages.layer_fwd_fresh,
                                           layer_bwd_cont=stages.layer_bwd_fresh)
            if_fresh = one_ms / pipelined_step_ms(as_fresh, num_layers=n, ranks=big_r)
            rows.append(dict(R=big_r, seq_len_per_rank=t, size=args.size, predicted_speedup=one_ms / cp_ms,
                             predicted_step_ms=cp_ms, one_gpu_step_ms=one_ms, one_gpu_from=one_from,
                             speedup_if_continuation_as_fresh=if_fresh,
                             date=measured,
                             device=name, layer_linearity_at_2T=linear, stages=stages.__dict__,
                             assumptions=dict(p2p_gbps=args.p2p_gbps, allreduce_gbps=args.allreduce_gbps,
                                              latency_us=args.latency_us)))
    print(f"\n{'R':>3} {'T/rank':>8} {'CP step ms':>11} {'1 GPU ms':>10} {'speedup':>8} {'if cont=fresh':>14}"
          "  one GPU")
    for r in rows:
        print(f"{r['R']:>3} {r['seq_len_per_rank']:>8} {r['predicted_step_ms']:>11.1f} {r['one_gpu_step_ms']:>10.1f} "
              f"{r['predicted_speedup']:>7.2f}x {r['speedup_if_continuation_as_fresh']:>13.2f}x  {r['one_gpu_from']}")
    print("assumptions: stage times from this device; messages (two per layer, each paying the latency) and the "
          f"gradient all-reduce overlap nothing ({args.p2p_gbps} / {args.allreduce_gbps} GB/s, {args.latency_us} us); "
          "parameters replicated over the cp ranks (the trainer's FSDP over dp_shard x cp lets a rank run at most "
          "one layer ahead); one GPU at R x T = R x the work at T unless measured at R x T (the layer's time at 2T "
          "over twice its time at T is in each row)")
    # Memory with activation checkpointing (every block): the fp32 parameters, gradients and AdamW state, each
    # block's saved input [T, dim] in bf16, and the larger of one block's recompute-and-backward peak and the
    # head's, per token as measured at the longest length.
    longest = max(args.seq_lens)
    st = timings[longest]
    memory = None
    total_gib = args.device_memory_gib
    if total_gib is None and device.type == "cuda":
        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    if st.get("layer_peak_gib") is not None and total_gib is not None:
        static_gib = 4 * st["param_bytes_fp32"] / 2**30  # weights, gradients, two AdamW moments
        per_token_gib = (n * margs.dim * 2) / 2**30 + max(st["layer_peak_gib"], st["head_peak_gib"]) / longest
        capacity_gib = 0.95 * total_gib
        memory = dict(static_gib=static_gib, per_token_gib=per_token_gib, capacity_gib=capacity_gib,
                      longest_one_gpu_tokens=int((capacity_gib - static_gib) / per_token_gib),
                      per_rank_gib_512k={big_r: static_gib + per_token_gib * (2**19 // big_r)
                                         for big_r in (1, 2, 4, 8)},
                      note="estimate: linear in T from the stage peaks at the longest measured length")
        per_rank = ", ".join(f"R={k}: {v:.1f} GiB" for k, v in memory["per_rank_gib_512k"].items())
        print(f"activation checkpointing (estimate): {static_gib:.1f} GiB + {per_token_gib * 2**20:.2f} GiB per 1M "
              f"tokens; longest sequence on one device ~{memory['longest_one_gpu_tokens']:,} tokens; a 512k-token "
              f"sequence over R ranks: {per_rank}")
    old = json.loads(args.prediction_out.read_text()) if args.prediction_out.exists() else []
    args.prediction_out.parent.mkdir(parents=True, exist_ok=True)
    args.prediction_out.write_text(json.dumps(old + rows, indent=1) + "\n")
    args.out.write_text(json.dumps({"device": name, "date": measured,
                                    "kernel_configs": args.kernel_configs_used.record(),
                                    "timings": {str(k): v for k, v in timings.items()},
                                    "rows": rows, "memory_with_ac": memory}, indent=1) + "\n")
    return 0


def stack(mixer, layers: int, x: dict, do: torch.Tensor) -> None:
    """Forward and backward of ``mixer(i, *inputs)`` for i in 0 .. layers - 1, layer i+1's queries being
    ``q + o_i``; gradients cleared after."""
    o = None
    for i in range(layers):
        o = mixer(i, x["q"] if o is None else x["q"] + o, *(x[n] for n in NAMES[1:]))
    o.backward(do)
    for n in NAMES:
        x[n].grad = None


def _install_kernel_configs(args, device):
    """fla's launch configurations for this process (before any fla launch; on a CPU the decision "off"), whose
    ``record()`` the JSON takes when it is written (what was served by then)."""
    from hola_titan.kernels.runtime import tuned_configs
    installed = tuned_configs.install(args.kernel_configs, device)
    print("fla kernel configurations:", installed.describe(), flush=True)
    return installed


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = "RANK" in os.environ
    if args.predict:
        if distributed:
            raise SystemExit("--predict runs in one process (it times one GPU's stages); run it without torchrun")
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        args.kernel_configs_used = _install_kernel_configs(args, device)
        return predict(args, device)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    configs_used = _install_kernel_configs(args, device)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    from hola_titan import hola_attention
    from hola_titan.ops import HolaSettings
    from hola_titan.kernels.runtime.documents import Documents
    from hola_titan.parallelisms.context_parallel import ContextParallel, build_layout
    from hola_titan.parallelisms.parallel_dims import end_process_group

    cp = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))["cp"]
        cp = ContextParallel(mesh, recurrent=True, conv_size=4)
    timer = Timer(device)
    kw = dict(window=args.window, block=args.block, evict=args.evict)
    rows = []
    for t in args.seq_lens:
        row = {"T": t, "docs": args.docs, "cp": world, "heads": args.heads, "dim": args.dim, **kw}
        if t % (world * args.block) or t % args.docs:
            raise SystemExit(f"--seq-lens: {t} must split into {world} shards of whole blocks of {args.block} "
                             f"and into {args.docs} documents")
        cu_list = [i * t // args.docs for i in range(args.docs + 1)]
        x, do = inputs(t, args, device, dtype)
        if cp is not None:
            layout = build_layout(cp_rank=rank, cp_size=world, num_rows=1, row_len=t, cu_seqlens=cu_list)
            cols = slice(layout.shard_start, layout.shard_start + layout.shard_len)
            local = {n: (x[n][:, cols] if n in ("q", "k", "v", "g", "beta") else x[n]).contiguous()
                     .requires_grad_() for n in NAMES}
            # As the trainer does: checked from the host copy, so no layer reads it back from the device.
            docs_local = Documents.from_host(torch.tensor(layout.local_cu_seqlens), device=device,
                                             seq_len=layout.shard_len)
            do_local = do[:, cols].contiguous()

            def cp_step():
                batch = cp.batch(layout)  # one batch per step: each layer's messages are kept in it
                layers = [batch.layer(i, head_dim=args.dim, settings=HolaSettings(**kw)) for i in range(args.layers)]
                stack(lambda i, *a: layers[i].attention(*a, documents=docs_local)[0], args.layers, local, do_local)

            try:
                dist.barrier()
                row["cp_ms"], row["cp_peak_gib"] = timer(cp_step, args.reps)
                cp.bytes_received = 0
                cp_step()
                per_rank = [None] * world
                dist.all_gather_object(per_rank, cp.bytes_received)
                row["comm_bytes_per_rank"] = per_rank
                row["cp_host_syncs"] = count_host_syncs(cp_step, device)
                if args.profile:
                    from hola_titan.profiling import kernel_profile
                    row["cp_profile"] = kernel_profile(cp_step, device=device, timed_ms=row["cp_ms"], iters=2,
                                                       label=f"rank {rank} CP T={t}")
            except torch.OutOfMemoryError:
                row["cp_ms"] = "out of memory"
            del local
        if rank == 0 and not args.no_single:
            full = {n: x[n].clone().requires_grad_() for n in NAMES}
            docs_full = Documents.from_host(torch.tensor(cu_list), device=device, seq_len=t)

            def single_step():
                stack(lambda i, *a: hola_attention(*a, documents=docs_full, **kw)[0], args.layers, full, do)

            try:
                row["single_ms"], row["single_peak_gib"] = timer(single_step, args.reps)
                row["single_host_syncs"] = count_host_syncs(single_step, device)
                if args.profile:
                    from hola_titan.profiling import kernel_profile
                    row["single_profile"] = kernel_profile(single_step, device=device, timed_ms=row["single_ms"],
                                                           iters=2, label=f"single T={t}")
            except torch.OutOfMemoryError:
                row["single_ms"] = "out of memory"
            del full
        if isinstance(row.get("cp_ms"), float) and isinstance(row.get("single_ms"), float):
            row["speedup"] = row["single_ms"] / row["cp_ms"]
        if use_cuda:
            torch.cuda.empty_cache()
        if distributed:
            dist.barrier()
        if rank == 0:
            print("row:", json.dumps(row), flush=True)
        rows.append(row)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                                        "torch": torch.__version__, "kernel_configs": configs_used.record(),
                                        "rows": rows}, indent=1) + "\n")
        print(f"\n{args.layers} layers\n{'T':>8} {'docs':>5} {'CP ms':>10} {'1 GPU ms':>10} {'speedup':>8} "
              f"{'comm KiB':>9} {'CP GiB':>8} {'1 GPU GiB':>10} {'CP syncs':>9}")
        for r in rows:
            r = dict(r, comm_kib=max(r["comm_bytes_per_rank"]) / 1024) if "comm_bytes_per_rank" in r else r
            print(f"{r['T']:>8} {r['docs']:>5} {_cell(r, 'cp_ms', '{:.2f}'):>10} {_cell(r, 'single_ms', '{:.2f}'):>10} "
                  f"{_cell(r, 'speedup', '{:.2f}x'):>8} "
                  f"{_cell(r, 'comm_kib', '{:.1f}'):>9} {_cell(r, 'cp_peak_gib', '{:.2f}'):>8} "
                  f"{_cell(r, 'single_peak_gib', '{:.2f}'):>10} {_cell(r, 'cp_host_syncs', '{}'):>9}")
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
