# A/B of the Gluon cache kernels: this tree's (new) against the previous version (prev), per kernel, same process.
# prev: `git show c0a60ae:hola_titan/kernels/hola_gluon_attn.py > .gpu/prev_gluon.py`; run from the repository root on an H200.
import sys, json, importlib.util, torch
import hola_titan.kernels as K
from hola_titan.kernels import hola_gluon_attn as NEW, hola_triton_attn as A, hola_triton_select as S
from hola_titan.kernels.hola_triton_ops import cache_attn_bwd_op, cache_attn_op
spec = importlib.util.spec_from_file_location("prev_gluon", ".gpu/prev_gluon.py")
PREV = importlib.util.module_from_spec(spec); spec.loader.exec_module(PREV)
dev = torch.device("cuda")
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
    return {ev.key[:40]: round(ev.device_time_total / reps / 1000, 4) for ev in prof.key_averages() if "gluon" in ev.key}
res = {}
for keep in (False, True):
    for name, mod in (("prev", PREV), ("new", NEW), ("prev2", PREV), ("new2", NEW)):
        use(mod)
        fwd = cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep)
        args = (do, q, k, v, fwd[1], fwd[2], fwd[3], gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window,
                fwd[4] if keep else None)
        times = kernel_ms(lambda: cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep))
        times.update(kernel_ms(lambda: cache_attn_bwd_op(*args)))
        res[f"{name}{'_keep' if keep else ''}"] = times
        print(name, "keep" if keep else "", json.dumps(times), flush=True)
use(NEW)
json.dump(res, open(sys.argv[1], "w"), indent=1)
