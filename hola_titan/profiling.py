"""Traces of training steps (``[profiling]``): ``torch.profiler`` on every rank, one traced step per window.

Each window of ``freq`` steps waits, records ``warmup`` steps that are dropped, then records one step and writes
``<dump_folder>/<traces_folder>/step-N/rank{R}.json.gz`` (a Chrome trace: CPU ops, and CUDA kernels and
collectives where there is a GPU; Perfetto opens it) and ``rank{R}.txt`` (the operators with the most self time).
Every rank writes its own, so a stall on one rank, or a collective that waits for another, is visible side by side.

:func:`kernel_profile` (for the benchmark scripts) profiles calls of a function instead: the device time of its
kernels by name and by kind (matrix products, fla, this project's kernels, Inductor, ATen, copies) against the
timed wall time, the GPU's idle gaps read off the kernels' timeline, and the ATen calls the host made.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from hola_titan.config import Profiling

logger = logging.getLogger(__name__)


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def step_profiler(config: Profiling, *, folder: Path, rank: int, device: torch.device, step_of: Callable[[], int]):
    """Yields an object whose ``step()`` the training loop calls after every step; a no-op when disabled.
    ``step_of()`` gives the training step a trace is named after."""
    if not config.enable:
        yield _NoProfiler()
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = device.type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof) -> None:
        out = folder / f"step-{step_of()}"
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(out / f"rank{rank}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        (out / f"rank{rank}.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40) + "\n")
        if rank == 0:
            logger.info("profiling: step %d traced to %s", step_of(), out)

    schedule = torch.profiler.schedule(wait=config.freq - config.warmup - 1, warmup=config.warmup, active=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write) as prof:
        yield prof


# ---------------------------------------------------------------------------------------------------------------
# Profiling calls of a function (the benchmark scripts)
# ---------------------------------------------------------------------------------------------------------------


def is_device_kernel(evt) -> bool:
    """Whether a ``key_averages()`` row is work on the GPU itself (a kernel, copy or fill). The rest also carry
    device time and would count it twice: host-side ops (ATen and custom ops, autograd nodes, NCCL's
    ``record_param_comms``) report their kernels' time as theirs, and GPU-side annotations of ranges span them."""
    from torch.autograd import DeviceType

    return evt.device_type == DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)


# Kinds of kernels by name, first match wins. This project's own Triton kernels are named in
# hola_titan/kernels/hola/ and kernels/fused/; fla's are the remaining Triton kernels of the GDN stages (chunk_*,
# l2norm, WY, solve_tril, causal_conv1d, ...).
_KINDS = (
    ("inductor", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
    ("hola_cache", ("_cache_", "_rstd_kernel", "_merge_topw", "_select", "_topw", "_recency")),
    ("hola_fused", ("_short_conv_", "_xent_")),
    ("fla", ("chunk", "l2norm", "recompute_w_u", "prepare_wy", "solve_tril", "merge_16", "kkt", "causal_conv",
             "layer_norm", "rms_norm", "swiglu", "cross_entropy", "logsumexp", "fused_")),
    ("copy", ("memcpy", "memset", "copy_kernel", "Memcpy", "Memset", "CatArray", "fill")),
    ("aten", ("at::native", "at_cuda_detail", "cub::", "void at::")),
    ("nccl", ("nccl",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel by its name (see ``_KINDS``); ``other`` when nothing matches."""
    for kind, needles in _KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def idle_gaps(intervals: list[tuple[float, float, str]], *, min_gap_us: float = 5.0, top: int = 10,
              host: list[tuple[float, float, str]] | None = None) -> dict:
    """GPU idle time between kernels: ``intervals`` are (start us, end us, kernel name) of every kernel of the
    profiled window. Returns the busy span, the idle time inside it (gaps of at least ``min_gap_us``) and the
    ``top`` largest gaps with the kernels before and after them.

    ``host``: (start us, end us, name) of the host's outermost operations (on any thread, on the kernels' clock).
    The GPU idles when the host has not yet issued the next kernel, so what the host was running inside the gaps
    is where idle time comes from: each reported gap gets its ``host`` operations by overlap, and
    ``host_in_gaps`` sums them over every gap (``no host operation``: time inside gaps in which none ran, i.e.
    Python between operations)."""
    if not intervals:
        return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    intervals = sorted(intervals)
    gaps, end, before = [], intervals[0][1], intervals[0][2]
    for start, stop, name in intervals[1:]:
        if start - end >= min_gap_us:
            gaps.append((start - end, before, name, end, start))
        if stop > end:
            end, before = stop, name
    span = end - intervals[0][0]
    gaps.sort(key=lambda g: -g[0])
    out = {"span_ms": span / 1e3, "idle_ms": sum(g[0] for g in gaps) / 1e3, "num_gaps": len(gaps),
           "gaps": [dict(us=round(g[0], 1), after=g[1][:70], before=g[2][:70]) for g in gaps[:top]]}
    if host is not None:
        host = sorted(host)
        starts, reach, most = [h[0] for h in host], [], float("-inf")
        for h in host:  # the latest end among the operations started so far: where a backward walk can stop
            most = max(most, h[1])
            reach.append(most)
        total: dict[str, float] = {}
        for rank, (_, _, _, g0, g1) in enumerate(gaps):
            j, near = bisect.bisect_left(starts, g1) - 1, []
            while j >= 0 and reach[j] > g0:
                near.append(host[j])
                j -= 1
            inside = _host_overlap(near, g0, g1)
            for name, us in inside.items():
                total[name] = total.get(name, 0.0) + us
            if rank < top:
                out["gaps"][rank]["host"] = {name: round(us, 1) for name, us in
                                             sorted(inside.items(), key=lambda kv: -kv[1])[:3]}
        out["host_in_gaps"] = [dict(op=name, us=round(us, 1)) for name, us in
                               sorted(total.items(), key=lambda kv: -kv[1])[:top]]
    return out


_NO_HOST_OP = "no host operation"


def _host_overlap(host: list[tuple[float, float, str]], g0: float, g1: float) -> dict[str, float]:
    """Microseconds of [g0, g1] each host operation (by name) covers, and the part no operation covers."""
    inside, covered = {}, []
    for start, stop, name in host:
        lo, hi = max(start, g0), min(stop, g1)
        if hi > lo:
            inside[name] = inside.get(name, 0.0) + hi - lo
            covered.append((lo, hi))
    union, reach = 0.0, g0
    for lo, hi in sorted(covered):
        if hi > reach:
            union += hi - max(lo, reach)
            reach = hi
    if g1 - g0 - union > 0:
        inside[_NO_HOST_OP] = g1 - g0 - union
    return inside


def _outermost_host_op(evt) -> bool:
    """A host operation no other operation encloses (an annotated phase such as ``Optimizer.step#AdamW.step`` or a
    compiled region, an autograd node on the backward thread, or an ATen call made from Python)."""
    from torch.autograd import DeviceType

    return (evt.device_type == DeviceType.CPU and getattr(evt, "cpu_parent", None) is None
            and not getattr(evt, "is_async", False) and evt.time_range.end > evt.time_range.start)


def kernel_profile(run, *, device: torch.device, timed_ms: float | None, iters: int = 5, top: int = 12,
                   label: str = "call", keep: int = 200) -> dict:
    """Profile ``iters`` calls of ``run()`` (warmed up by the caller); per-call numbers, printed and returned.

    ``top`` kernels are printed; ``keep`` are kept in the returned ``kernels`` list (all kinds are summed in
    ``by_kind`` whatever ``keep`` is)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(iters):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    per_name, aten_calls, intervals, aten_by_name, host = {}, 0, [], {}, []
    if cuda:
        for evt in prof.events():
            if is_device_kernel(evt) and evt.time_range.end > evt.time_range.start:
                intervals.append((evt.time_range.start, evt.time_range.end, evt.name))
            elif _outermost_host_op(evt):
                host.append((evt.time_range.start, evt.time_range.end, evt.name))
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            aten_calls += evt.count
            aten_by_name[evt.key] = aten_by_name.get(evt.key, 0) + evt.count
        if cuda:
            if not is_device_kernel(evt):
                continue
            us = getattr(evt, "self_device_time_total", None)
            us = evt.self_cuda_time_total if us is None else us
        else:
            if not evt.key.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        if us > 0:
            per_name[evt.key[:90]] = (us / iters / 1000, evt.count // iters)
    busy_ms = sum(ms for ms, _ in per_name.values())
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    by_kind: dict[str, float] = {}
    for name, (ms, _) in per_name.items():
        kind = kernel_kind(name) if cuda else "cpu"
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    out = dict(kernel_ms=busy_ms, timed_ms=timed_ms, launches=sum(n for _, n in per_name.values()),
               aten_calls=aten_calls // iters,
               # Where the host's calls go (each costs microseconds of host time whatever its kernel does).
               aten_top=[dict(op=k, calls=round(n / iters, 2))
                         for k, n in sorted(aten_by_name.items(), key=lambda kv: -kv[1])[:top]],
               by_kind={k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
               top=[dict(kernel=k, ms=round(ms, 4), launches=n) for k, (ms, n) in ranked[:top]],
               kernels=[dict(kernel=k, kind=kernel_kind(k) if cuda else "cpu", ms=round(ms, 4), launches=n)
                        for k, (ms, n) in ranked[:keep]])
    if cuda:
        gaps = idle_gaps(intervals, host=host)
        # Per call: the window holds ``iters`` calls back to back.
        out["gpu_idle"] = dict(gaps, span_ms=gaps["span_ms"] / iters, idle_ms=gaps["idle_ms"] / iters,
                               host_in_gaps=[dict(op=h["op"], ms=round(h["us"] / iters / 1e3, 3))
                                             for h in gaps.get("host_in_gaps", [])])
    what = "kernels" if cuda else "ATen self CPU"
    timed = f"{timed_ms:.3f}" if timed_ms is not None else "-"
    print(f"profile ({label}): {what} {busy_ms:.3f} ms per call, timed {timed} ms, launches {out['launches']}, "
          f"ATen calls {out['aten_calls']}", flush=True)
    print("    by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in out["by_kind"].items()), flush=True)
    if "gpu_idle" in out:
        idle = out["gpu_idle"]
        print(f"    GPU idle {idle['idle_ms']:.2f} ms of a {idle['span_ms']:.2f} ms span per call; largest gaps: "
              + "; ".join(f"{g['us']:.0f} us after {g['after'][:40]}" for g in idle["gaps"][:4]), flush=True)
        print("    host inside the gaps (ms per call): "
              + ", ".join(f"{h['op'][:60]} {h['ms']:.2f}" for h in idle["host_in_gaps"][:8]), flush=True)
    for item in out["top"]:
        print(f"    {item['ms']:8.3f} ms  x{item['launches']:<4d} {item['kernel']}", flush=True)
    print("    ATen calls: " + ", ".join(f"{a['op'].removeprefix('aten::')} {a['calls']}" for a in out["aten_top"]),
          flush=True)
    return out
