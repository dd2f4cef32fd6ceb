# Gluon vs Triton cache backward at the op level: relative differences per output, NaN counts.
import torch
from hola_titan.kernels import hola_triton_attn as A, hola_triton_select as S
from hola_titan.kernels.hola_triton_ops import cache_attn_bwd_op, cache_attn_op
A.POISON_OUTPUTS = True
dev = torch.device("cuda")
for (t, cu, window, keep) in [(4096, [0, 1, 2000, 2001, 4096], 64, False), (4096, [0, 1, 2000, 2001, 4096], 64, True),
                              (1500, [0, 600, 601, 1500], 8, False), (500, [0, 500], 0, False), (1000, [0, 1000], 64, False)]:
    b, h, d, block = 1, 4, 256, 256
    g = torch.Generator(device=dev).manual_seed(3)
    q, k, v, o_state, do = (torch.randn(b, t, h, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(5))
    gq, gk = (1 + 0.3 * torch.randn(d, device=dev, generator=g) for _ in range(2))
    sink, gate = torch.randn(h, device=dev, generator=g), torch.randn(h, device=dev, generator=g)
    cu_t = torch.tensor(cu, device=dev)
    table = S.build_block_table(b, t, cu_t, block, dev)
    m = torch.rand(b * t, h, device=dev, generator=g)
    sel, _ = S.select_topw(m, table, window)
    fo = {}
    for kern in ("triton", "gluon"):
        A.FORWARD[256] = kern
        fo[kern] = cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep)
        torch.cuda.synchronize()
    frep = {}
    for i, name in enumerate(("o", "lse", "rq", "rk", "oc")[:len(fo["gluon"])]):
        a, c = fo["gluon"][i].double(), fo["triton"][i].double()
        frep[name] = (f"{float((a - c).norm() / c.norm().clamp_min(1e-30)):.2e}", int(torch.isnan(a).sum()))
    print(f"fwd T{t} W{window} keep={keep}:", frep, flush=True)
    fwd = fo["triton"]
    args = (do, q, k, v, fwd[1], fwd[2], fwd[3], gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window,
            fwd[4] if keep else None)
    out = {}
    for kern in ("gluon", "triton"):
        A.BACKWARD[256] = kern
        out[kern] = cache_attn_bwd_op(*args)
        torch.cuda.synchronize()
    A.BACKWARD[256] = "gluon"
    rep = {}
    for name, a, c in zip(("dq", "dk", "dv", "dgq", "dgk", "dsink", "dgate"), out["gluon"], out["triton"]):
        a, c = a.double(), c.double()
        rep[name] = (f"{float((a - c).norm() / c.norm().clamp_min(1e-30)):.2e}", int(torch.isnan(a).sum()))
    print(f"T{t} W{window} keep={keep}:", rep, flush=True)
