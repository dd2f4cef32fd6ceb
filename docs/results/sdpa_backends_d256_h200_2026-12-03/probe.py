"""Probe: how fast do torch's fused attention backends run the cache read's shapes at head dim 256 on this GPU?

The cache read of one block is a dense attention: the block's queries (up to ``block`` rows) against the block's
``window`` selected cache entries (all visible) and the block's own rows (causal). This times, at the benchmark's
340M shape (65,536 tokens, 4 heads x 256, window 64, block 256), bf16:
  own:   [blocks, H, 256, D] x its own rows, causal (a block-diagonal causal attention);
  cache: [blocks, H, 256, D] x [blocks, H, 64, D], no mask;
  both:  [blocks, H, 256, D] x [blocks, H, 320, D], bottom-right causal (cache entries first);
under each SDPA backend that accepts the case, forward and forward + backward, with TFLOP/s by the pairs computed
(4 * pairs * D forward, 2.5x that backward, the count bench_hola_attention.py uses). It prints one JSON line per
case and writes them all to --out.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--tokens", type=int, default=65536)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--dim", type=int, default=256)
p.add_argument("--window", type=int, default=64)
p.add_argument("--block", type=int, default=256)
args = p.parse_args()
nb, h, lq, w, d = args.tokens // args.block, args.heads, args.block, args.window, args.dim
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()


q = rand(nb, h, lq, d)
k_own, v_own = rand(nb, h, lq, d), rand(nb, h, lq, d)
k_c, v_c = rand(nb, h, w, d), rand(nb, h, w, d)
k_both = torch.cat([k_c, k_own], 2).detach().requires_grad_()
v_both = torch.cat([v_c, v_own], 2).detach().requires_grad_()
pairs = {"own": nb * h * lq * (lq + 1) // 2, "cache": nb * h * lq * w, "both": nb * h * (lq * w + lq * (lq + 1) // 2)}
cases = {
    "own": lambda: F.scaled_dot_product_attention(q, k_own, v_own, is_causal=True),
    "cache": lambda: F.scaled_dot_product_attention(q, k_c, v_c),
    "both": lambda: F.scaled_dot_product_attention(q, k_both, v_both, attn_mask=causal_lower_right(lq, lq + w)),
    "both_mask": lambda: F.scaled_dot_product_attention(
        q, k_both, v_both, attn_mask=torch.ones(lq, lq + w, device=dev, dtype=torch.bool).tril(w)),
}
backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "blocks": nb, "heads": h, "block": lq, "window": w, "dim": d}
print(json.dumps(meta), flush=True)
rows = []
for case, fn in cases.items():
    n = pairs["both" if case.startswith("both") else case]
    flops_f = 4 * n * d
    for name, backend in backends.items():
        row = {"case": case, "backend": name}
        try:
            with sdpa_kernel([backend]):
                o = fn()
                do = torch.randn_like(o)
                fwd = do_bench(fn, rep=200)
                fb = do_bench(lambda: torch.autograd.grad(fn(), (q,), do), rep=200)  # noqa: B023
            row.update(fwd_ms=fwd, fwd_bwd_ms=fb, bwd_ms=fb - fwd, fwd_tflops=flops_f / fwd / 1e9,
                       bwd_tflops=2.5 * flops_f / (fb - fwd) / 1e9)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
with open(args.out, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
