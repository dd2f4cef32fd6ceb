"""Reproduces the Inductor gradient discrepancy that keeps the reference backend out of torch.compile.

Compiles ``hola_attention_reference`` (GDN mode) with a given backend and compares input gradients with eager.
On torch 2.13 CPU: ``eager`` and ``aot_eager`` match exactly; ``inductor`` gives relative errors of about 1 for
the gradients of k, g and beta while the forward matches. Run: ``python scripts/repro/inductor_reference_grad.py``.
"""

import sys

import torch

from hola_titan.kernels.hola.reference import hola_attention_reference


def main(backend: str) -> None:
    torch.manual_seed(0)
    b, t, h, d = 2, 64, 2, 16
    xs = [torch.randn(b, t, h, d, requires_grad=True) for _ in range(3)]
    xs += [(-torch.rand(b, t, h)).requires_grad_(), torch.rand(b, t, h).requires_grad_()]
    # The undecorated function: the module wraps it in torch.compiler.disable for exactly this reason.
    fn = getattr(hola_attention_reference, "__wrapped__", hola_attention_reference)

    def f(q, k, v, g, beta):
        return fn(q, k, v, g, beta, None, None, None, None, window=0, block=1, evict="none", cu_seqlens=None,
                  initial_state=None, output_final_state=False, initial_cache=None, output_final_cache=False)[0]

    out = f(*xs)
    weight = torch.randn_like(out)
    eager = torch.autograd.grad((out * weight).sum(), xs)
    compiled_out = torch.compile(f, backend=backend)(*xs)
    compiled = torch.autograd.grad((compiled_out * weight).sum(), xs)
    print(f"backend {backend}: forward max diff {(out - compiled_out).abs().max().item():.2e}")
    for name, a, c in zip(("q", "k", "v", "g", "beta"), eager, compiled):
        print(f"  d{name}: relative L2 error {((a - c).norm() / a.norm()).item():.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "inductor")
