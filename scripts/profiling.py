"""Where a call's time goes, through ``torch.profiler``: shared by the benchmark scripts beside it.

On CUDA: the summed device time of the call's kernels by name, against the call's timed wall time (the rest is
time the GPU idled: launch gaps, host work, synchronisations), and the number of ATen calls the host made (the
measure of host-bound work). On the CPU: self CPU time by ATen op.
"""

from __future__ import annotations

import torch


def is_device_kernel(evt) -> bool:
    """Whether a ``key_averages()`` row is work on the GPU itself (a kernel, copy or fill). The rest also carry
    device time and would count it twice: host-side ops (ATen and custom ops, autograd nodes, NCCL's
    ``record_param_comms``) report their kernels' time as theirs, and GPU-side annotations of ranges span them."""
    from torch.autograd import DeviceType

    return evt.device_type == DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)


def kernel_profile(run, *, device: torch.device, timed_ms: float | None, iters: int = 5, top: int = 12,
                   label: str = "call") -> dict:
    """Profile ``iters`` calls of ``run()`` (warmed up by the caller); per-call numbers, printed and returned."""
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
    per_name, aten_calls = {}, 0
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            aten_calls += evt.count
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
    out = dict(kernel_ms=busy_ms, timed_ms=timed_ms, launches=sum(n for _, n in per_name.values()),
               aten_calls=aten_calls // iters,
               top=[dict(kernel=k, ms=round(ms, 4), launches=n) for k, (ms, n) in ranked[:top]])
    what = "kernels" if cuda else "ATen self CPU"
    timed = f"{timed_ms:.3f}" if timed_ms is not None else "-"
    print(f"profile ({label}): {what} {busy_ms:.3f} ms per call, timed {timed} ms, launches {out['launches']}, "
          f"ATen calls {out['aten_calls']}", flush=True)
    for item in out["top"]:
        print(f"    {item['ms']:8.3f} ms  x{item['launches']:<4d} {item['kernel']}", flush=True)
    return out
