"""Continuing vs fresh mixer at 64k: synced per call vs back to back; the staged backward vs fla's fused dh0."""
import argparse, json, sys, time
import torch
sys.path.insert(0, "scripts")
import bench_context_parallel as B
from hola_titan.kernels import fla_gdn
from hola_titan.kernels.hola_continue import ContinuationLayout
from hola_titan.models.args import model_args
from hola_titan.ops import hola_attention

dev = torch.device("cuda")
from hola_titan.kernels import tuned_configs
tuned_configs.install("auto", dev)
t = 65536
m = model_args("hola", "340M", vocab_size=32000)
h, d = m.n_heads, m.head_dim
mix, do = B.inputs(t, argparse.Namespace(heads=h, dim=d), dev, torch.bfloat16)
full = {n: mix[n].requires_grad_() for n in B.NAMES}
state = (0.01 * torch.randn(1, h, d, d, device=dev)).requires_grad_()
cache, seen = B.boundary_cache(1, h, d, window=m.window, block=m.block, evict=m.evict, dtype=torch.bfloat16, device=dev)
leaves = [state, cache.k, cache.v, cache.buf_k, cache.buf_v]
cont = ContinuationLayout.from_host([seen], None, batch=1, seq_len=t, window=m.window, block=m.block, device=dev)
kw = dict(window=m.window, block=m.block, evict=m.evict)

def mixer(initial):
    def run():
        extra = dict(initial_state=state, initial_cache=cache, continuation=cont) if initial else {}
        o, _ = hola_attention(*(full[n] for n in B.NAMES), **kw, **extra)
        o.backward(do)
        for x in [*full.values(), *leaves]:
            x.grad = None
    return run

new_bwd = fla_gdn._bwd_from_initial_state
def old_bwd(qn, kn, v, g_cum, beta, a, scale, initial_state, do, dht, cu, ci):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(q=qn, k=kn, v=v, g=g_cum, beta=beta, A=a, scale=scale,
        initial_state=initial_state, do=do, dht=dht, cu_seqlens=cu, chunk_indices=ci, chunk_size=64)
    return dq, dk, dv, db, dg, dh0

def synced(fn, reps):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]

def b2b(fn, reps):
    torch.cuda.synchronize(); fn(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / reps

def host(fn, reps):  # host ms per call when the GPU is never waited for (queue grows): an upper bound of host cost
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / reps

rows = {}
for name in ("fresh", "cont_new", "cont_old"):
    fla_gdn._bwd_from_initial_state = old_bwd if name == "cont_old" else new_bwd
    mixer(name != "fresh")()
for rnd in range(3):
    for name in ("fresh", "cont_new", "cont_old"):
        fla_gdn._bwd_from_initial_state = old_bwd if name == "cont_old" else new_bwd
        fn = mixer(name != "fresh")
        r = rows.setdefault(name, {"synced": [], "b2b": [], "host": []})
        r["synced"].append(synced(fn, 11)); r["b2b"].append(b2b(fn, 10)); r["host"].append(host(fn, 5))
fla_gdn._bwd_from_initial_state = new_bwd
syncs = {n: B.count_host_syncs(mixer(n != "fresh"), dev) for n in ("fresh", "cont_new")}
for n, r in rows.items():
    print(n, {k: " ".join(f"{x:.2f}" for x in v) for k, v in r.items()})
print("host syncs", syncs)
json.dump({"rows": rows, "syncs": syncs}, open(sys.argv[1], "w"), indent=1)
import traceback
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    mixer(False)()
    print("fresh: no sync under error mode")
except Exception:
    print("fresh sync at:", traceback.format_exc()[-3000:])
finally:
    torch.cuda.set_sync_debug_mode("default")
