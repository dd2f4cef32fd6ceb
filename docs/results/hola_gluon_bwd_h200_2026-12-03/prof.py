# Per-kernel GPU time of the cache-read backward (Gluon and Triton) at the benchmark's 340M shape, T 2048 packed.
import sys, json, torch
from hola_titan.kernels import hola_triton_attn as A, hola_triton_select as S
from hola_titan.kernels.hola_triton_ops import cache_attn_bwd_op, cache_attn_op
dev = torch.device("cuda")
tokens, t, h, d, block, window = 65536, 2048, 4, 256, 256, 64
g = torch.Generator(device=dev).manual_seed(3)
q, k, v, o_state, do = (torch.randn(1, tokens, h, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(5))
gq, gk = (1 + 0.3 * torch.randn(d, device=dev, generator=g) for _ in range(2))
sink, gate = torch.randn(h, device=dev, generator=g), torch.randn(h, device=dev, generator=g)
cu = torch.arange(0, tokens + 1, t, device=dev)
table = S.build_block_table(1, tokens, cu, block, dev)
m = torch.rand(tokens, h, device=dev, generator=g)
sel, _ = S.select_topw(m, table, window)
res = {}
for keep in (False, True):
    fwd = cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, keep)
    args = (do, q, k, v, fwd[1], fwd[2], fwd[3], gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window,
            fwd[4] if keep else None)
    for kern in ("gluon", "triton"):
        A.BACKWARD[256] = kern
        for _ in range(3):
            cache_attn_bwd_op(*args)
        torch.cuda.synchronize()
        reps = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                cache_attn_bwd_op(*args)
            torch.cuda.synchronize()
        times = {}
        for ev in prof.key_averages():
            ms = getattr(ev, "device_time_total", 0) / reps / 1000
            if ms > 0.002:
                times[ev.key[:60]] = round(ms, 4)
        times = dict(sorted(times.items(), key=lambda kv: -kv[1]))
        res[f"{kern}{'_keep' if keep else ''}"] = times
        print(kern, "keep" if keep else "", json.dumps(times), flush=True)
A.BACKWARD[256] = "gluon"
json.dump(res, open(sys.argv[1], "w"), indent=1)
