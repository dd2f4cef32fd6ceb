# A/B of the Gluon cache kernels: this tree's (new, and new2 after the variants) against variant modules (a copy of
# hola_titan/kernels/hola_gluon_attn.py with one of variants/*.patch applied), per kernel, in one process.
import sys, json, importlib.util, torch
import hola_titan.kernels as K
from hola_titan.kernels import hola_gluon_attn as NEW, hola_triton_attn as A, hola_triton_select as S
from hola_titan.kernels.hola_triton_ops import cache_attn_bwd_op, cache_attn_op
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod
# usage: ab.py OUT.json [variant.py ...]: each variant module timed beside new
VARIANTS = [(p.rsplit("/", 1)[-1][:-3], load(p, "var_" + str(i))) for i, p in enumerate(sys.argv[2:])]
dev = torch.device("cuda")
# Every output the dispatch allocates is filled with NaN (indices: the most negative value) first, so a variant that
# leaves rows unwritten fails the comparison instead of reusing the previous run's memory (the fills are not timed:
# only kernels named gluon / persistent / _ws_ are counted).
A.POISON_OUTPUTS = True
tokens, t, h, d, block, window = 65536, 2048, 4, 256, 256, 64
g = torch.Generator(device=dev).manual_seed(3)
q, k, v, o_state, do = (torch.randn(1, tokens, h, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(5))
gq, gk = (1 + 0.3 * torch.randn(d, device=dev, generator=g) for _ in range(2))
sink, gate = torch.randn(h, device=dev, generator=g), torch.randn(h, device=dev, generator=g)
cu = torch.arange(0, tokens + 1, t, device=dev)
table = S.build_block_table(1, tokens, cu, block, dev)
sel, _ = S.select_topw(torch.rand(tokens, h, device=dev, generator=g), table, window)
def use(mod):
    K.hola_gluon_attn = mod; sys.modules["hola_titan.kernels.hola_gluon_attn"] = mod
def kernel_ms(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    return {ev.key[:40]: round(ev.device_time_total / reps / 1000, 4) for ev in prof.key_averages() if "gluon" in ev.key or "persistent" in ev.key or "_ws_" in ev.key}
# Correctness on ragged documents first (partial blocks, a one-token document, blocks shorter than a query tile):
# the timing shape below has only full blocks, so the kernels' partial-tile and past-the-end branches run here.
lens = [300, 1, 33, 700, 64, 65, 2000, 129]
rcu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
rt = int(rcu[-1])
rtable = S.build_block_table(1, rt, rcu, block, dev)
rsel, _ = S.select_topw(torch.rand(rt, h, device=dev, generator=g), rtable, window)
rq_, rk_, rv_, ros_, rdo_ = (x[:, :rt].contiguous() for x in (q, k, v, o_state, do))
def ragged(mod, keep):
    use(mod)
    f = cache_attn_op(rq_, rk_, rv_, ros_, gq, gk, sink, gate, rsel, rtable.blk_start, rtable.blk_len, block, window, keep)
    b = cache_attn_bwd_op(rdo_, rq_, rk_, rv_, f[1], f[2], f[3], gq, gk, sink, gate, rsel, rtable.blk_start, rtable.blk_len,
                          block, window, f[4] if keep else None)
    torch.cuda.synchronize()
    return [f[0]] + list(b)
for name, mod in VARIANTS:
    for keep in (False, True):
        ref = ragged(NEW, keep)
        got = ragged(mod, keep)
        diffs = [float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
        print(name, "ragged", "keep" if keep else "", "rel. diff vs new (o, dq, dk, dv, dgq, dgk, dsink, dgate):",
              ["%.1e" % x for x in diffs], "NaN" if any(torch.isnan(a).any() for a in got) else "", flush=True)
res = {}
for keep in (False, True):
    globals().pop("ref_out", None)
    for name, mod in [("new", NEW), *VARIANTS, ("new2", NEW)]:
        use(mod)
        fwd = cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep)
        args = (do, q, k, v, fwd[1], fwd[2], fwd[3], gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window,
                fwd[4] if keep else None)
        out = [fwd[0]] + list(cache_attn_bwd_op(*args))
        if name == "new":
            ref_out = out
        elif name != "prev" and "ref_out" in globals():
            diffs = [float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(out, ref_out)]
            print(name, "rel. diff vs new (o, dq, dk, dv, dgq, dgk, dsink, dgate):", ["%.1e" % x for x in diffs],
                  "NaN" if any(torch.isnan(a).any() for a in out) else "", flush=True)
        times = kernel_ms(lambda: cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep))
        times.update(kernel_ms(lambda: cache_attn_bwd_op(*args)))
        res[f"{name}{'_keep' if keep else ''}"] = times
        print(name, "keep" if keep else "", json.dumps(times), flush=True)
use(NEW)
json.dump(res, open(sys.argv[1], "w"), indent=1)
