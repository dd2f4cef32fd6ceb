"""Forward + backward time of the building blocks of a 340M block, each path against the bytes it must move.

At the trainer's shapes (one packed row of ``--tokens`` tokens with ``cu_seqlens`` as ``data.varlen`` makes them,
width 1024, bf16 activations): the short convolution over q, k, v (this project's PyTorch function eagerly and
under ``torch.compile``, and fla-core's ``causal_conv1d`` Triton kernels), RMSNorm and SwiGLU. Each row reports
the median time (``triton.testing.do_bench``) and the byte floor (every input read once, every output written
once, forward and backward, at the copy bandwidth measured in the same process), so a path far above its floor
shows itself. GPU only; prints a table and writes JSON (``--out``).

    python scripts/bench_ops.py --out outputs/bench_ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITEMS = ("conv_eager", "conv_compiled", "conv_fla", "conv_fused", "norm_compiled", "swiglu_compiled")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench_ops.json"))
    p.add_argument("--tokens", type=int, default=32768, help="tokens per call (one packed row)")
    p.add_argument("--dim", type=int, default=1024, help="channels of each of q, k, v; model width")
    p.add_argument("--hidden", type=int, default=2816, help="SwiGLU hidden width")
    p.add_argument("--docs", type=int, default=64, help="documents in the packed row (random lengths)")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated rows, of {', '.join(ITEMS)}")
    args = p.parse_args(argv)
    unknown = [item for item in args.items.split(",") if item not in ITEMS]
    if unknown:
        p.error(f"--items: unknown {', '.join(unknown)}; expected some of {', '.join(ITEMS)}")
    return args


def main(argv=None) -> int:
    args = _args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    from hola_titan.kernels.runtime.documents import to_device
    from hola_titan.models.layers import ShortConvolution, _RMSNormFunction, _SwiGLUFunction, document_positions

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    n, c = args.tokens, args.dim
    cuts = sorted(set([0, n] + torch.randint(1, n, (args.docs - 1,), generator=gen).tolist()))
    host = torch.tensor(cuts, dtype=torch.int64)
    cu = to_device(host, device)
    positions = document_positions(1, n, cu, device)

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median"))

    # Copy bandwidth (read + write) for the byte floors.
    buf = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    copy_ms = bench(lambda: dst.copy_(buf))
    bandwidth = 2 * buf.numel() / (copy_ms * 1e-3)
    buf = dst = None
    rows = []

    def row(name, fn, floor_bytes, note=""):
        if name not in args.items.split(","):
            return
        try:
            fn()
            ms = bench(fn)
            rows.append(dict(item=name, ms=ms, floor_ms=1e3 * floor_bytes / bandwidth, note=note))
        except Exception as err:  # noqa: BLE001 - report and go on
            rows.append(dict(item=name, error=f"{type(err).__name__}: {str(err)[:300]}"))
        print(rows[-1], flush=True)

    # Short convolution over q, k, v: x [1, n, 3c] read forward; backward reads x and dy, writes dx.
    x3 = [torch.randn(1, n, c, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dy3 = [torch.randn(1, n, c, device=device, dtype=torch.bfloat16) for _ in range(3)]
    convs = [ShortConvolution(c, 4).to(device) for _ in range(3)]
    for conv in convs:
        conv.init_weights()
    conv_bytes = 3 * n * c * 2 * (2 + 3)

    def conv_ref():
        outs = [conv(x, positions=positions)[0] for conv, x in zip(convs, x3)]
        torch.autograd.backward(outs, dy3)

    compiled = [torch.compile(conv) for conv in convs]

    def conv_compiled():
        outs = [conv(x, positions=positions)[0] for conv, x in zip(compiled, x3)]
        torch.autograd.backward(outs, dy3)

    row("conv_eager", conv_ref, conv_bytes, "ShortConvolution, 3 calls")
    row("conv_compiled", conv_compiled, conv_bytes, "torch.compile(ShortConvolution), 3 calls")
    try:
        from fla.modules.causal_conv1d import causal_conv1d

        def conv_fla():
            outs = [causal_conv1d(x, weight=conv.weight.view(c, 4).to(x.dtype), activation="silu", cu_seqlens=cu,
                                  cu_seqlens_cpu=host)[0] for conv, x in zip(convs, x3)]
            torch.autograd.backward(outs, dy3)
        row("conv_fla", conv_fla, conv_bytes, "fla causal_conv1d (Triton), 3 calls")
    except ImportError as err:
        rows.append(dict(item="conv_fla", error=str(err)))
    try:
        from hola_titan.kernels.fused.short_conv import short_conv_qkv

        weight3 = [conv.weight for conv in convs]

        def conv_fused():
            outs = short_conv_qkv(x3, weight3, cu_seqlens=cu)
            torch.autograd.backward(list(outs), dy3)
        row("conv_fused", conv_fused, conv_bytes, "hola_titan.kernels.fused.short_conv, one launch each way")
    except ImportError as err:
        rows.append(dict(item="conv_fused", error=str(err)))

    # RMSNorm over the model width (float32 statistics, bf16 out): x read twice (fwd, bwd), dy read, y, dx written.
    x = torch.randn(1, n, c, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(c, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    norm_bytes = n * c * 2 * 5

    @torch.compile
    def norm_fn(x, w):
        return _RMSNormFunction.apply(x, w, 1e-6, torch.bfloat16)

    row("norm_compiled", lambda: norm_fn(x, w).backward(dy), norm_bytes, "torch.compile(_RMSNormFunction)")

    # SwiGLU: a, b read (fwd), a, b, dp read and da, db written (bwd), p written.
    a = torch.randn(1, n, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(a, requires_grad=True)
    dp = torch.randn_like(a)

    @torch.compile
    def swiglu(a, b):
        return _SwiGLUFunction.apply(a, b)

    row("swiglu_compiled", lambda: swiglu(a, b).backward(dp), n * args.hidden * 2 * 8, "torch.compile(_SwiGLUFunction)")

    meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                tokens=n, dim=c, docs=len(cuts) - 1, copy_tb_s=bandwidth / 1e12, date=time.strftime("%Y-%m-%d %H:%M"))
    os.makedirs(args.out.parent, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'item':<18}{'ms':>9}{'floor ms':>10}{'x floor':>9}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['item']:<18}  {r['error'][:100]}")
        else:
            print(f"{r['item']:<18}{r['ms']:>9.3f}{r['floor_ms']:>10.3f}{r['ms'] / r['floor_ms']:>9.1f}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
