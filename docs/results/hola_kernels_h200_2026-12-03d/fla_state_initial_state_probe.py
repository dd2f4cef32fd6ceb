"""fla's chunk_gated_delta_rule fwd+bwd at T 65536, 4 x 256, with and without an initial state (with gradient)
and a final state: the continuing mixer's +1.1 ms in chunk_gated_delta_rule_bwd_kernel_dhu (2026-12-03)."""
import torch, triton
from hola_titan.kernels import fla_gdn, tuned_configs
dev = torch.device("cuda")
print("configs:", tuned_configs.install("auto", dev))
fla_gdn.ensure_backward_checked(256, dev)
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
T, H, D = 65536, 4, 256
g = torch.Generator(device=dev).manual_seed(0)
def mk(*s, scale=1.0):
    return (scale * torch.randn(*s, device=dev, generator=g)).bfloat16().requires_grad_()
q, k, v = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
gg = (-torch.rand(1, T, H, device=dev, generator=g) * 0.1).requires_grad_()
beta = torch.rand(1, T, H, device=dev, generator=g).bfloat16().requires_grad_()
h0 = (0.01 * torch.randn(1, H, D, D, device=dev, generator=g)).requires_grad_()
do = torch.randn(1, T, H, D, device=dev, generator=g).bfloat16()
cu = torch.tensor([0, T], device=dev, dtype=torch.int64)
for name, init, final, packed in [("fresh", False, False, False), ("fresh+final", False, True, False),
                                  ("h0", True, False, False), ("h0+final", True, True, False),
                                  ("fresh packed", False, False, True), ("h0 packed", True, False, True)]:
    def run():
        with fla_gdn.fla_backward_allowed(256, dev):
          o, ht = chunk_gated_delta_rule(q, k, v, gg, beta, initial_state=h0 if init else None,
                                       output_final_state=final, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu if packed else None)
          loss = (o * do).sum() + (ht.sum() if final else 0)
          loss.backward()
        for t in (q, k, v, gg, beta, h0):
            t.grad = None
    run()
    ms = triton.testing.do_bench(run, rep=300)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(); torch.cuda.synchronize()
    ker = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if "dhu" in e.key or "fwd_kernel_h" in e.key}
    print(f"{name:14s} fwd+bwd {ms:7.3f} ms  " + ", ".join(f"{k[:48]} {v:.3f}" for k, v in ker.items()), flush=True)
