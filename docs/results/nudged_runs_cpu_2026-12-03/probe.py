"""Plain PyTorch's float32 error on the debug model's parameter gradients, over token draws: the probe behind the
whole-model bound of tests/interpreter/fused_kernels.py (docs/LOG.md, 2026-12-03, tenth session).

For each token draw: the model with the fused Triton kernels (float32, Triton's interpreter), the plain PyTorch
model in float32 at the original weights and at seven weights moved by one ulp (tests/helpers.py, nudge_weights),
all against the float64 model at the original weights; relative L2 error per gradient, in float32 roundoff units.
Writes {seed: {param: [kernels, plain, nudged 1..7]}}; ``--summary`` prints the worst ratio of the kernels' error to
the bound (2 x the largest plain error + 16 units) over the draws, for K = 1, 4 and 8 plain runs.

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 PYTHONPATH=tests python docs/results/nudged_runs_cpu_2026-12-03/probe.py \\
        --flavour hola --seeds 0 12 --out fk3_hola.json
    python docs/results/nudged_runs_cpu_2026-12-03/probe.py --summary fk3_hola.json fk3_gdn.json
"""

import argparse
import json

U = 2.0 ** -24


def run(flavour, first, last, out):
    import torch
    from helpers import model_grads
    from hola_titan.models.args import model_args

    torch.set_num_threads(1)

    def grads(args, tokens, cu, kernels, dtype, nudge=None):
        return model_grads(args, tokens, cu, kernels, dtype, nudge)[1]

    rows = {}
    for seed in range(first, last):
        torch.manual_seed(seed)
        args = model_args(flavour, "debug", vocab_size=97, n_layers=2)
        tokens, cu = torch.randint(0, 97, (1, 80)), torch.tensor([0, 30, 31, 80])
        exact = grads(args, tokens, cu, "reference", torch.float64)
        kern = grads(args, tokens, cu, "triton", torch.float32)
        plain = [grads(args, tokens, cu, "reference", torch.float32, None if k == 0 else k) for k in range(8)]

        def rel(g, n):
            return ((g[n].double() - exact[n]).norm() / exact[n].norm()).item() / U
        rows[seed] = {n: [rel(kern, n)] + [rel(g, n) for g in plain] for n in exact}
    json.dump(rows, open(out, "w"))


def summary(paths):
    for path in paths:
        rows = json.load(open(path))
        for k in (1, 4, 8):
            worst = max((v[0] / (2 * max(v[1:1 + k]) + 16), s, n) for s, vv in rows.items() for n, v in vv.items())
            print(f"{path}: {k} plain run(s): worst ratio {worst[0]:.2f} (draw {worst[1]}, {worst[2]})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--flavour", default="hola")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 12])
    p.add_argument("--out", default="fk3.json")
    p.add_argument("--summary", nargs="*")
    a = p.parse_args()
    summary(a.summary) if a.summary is not None else run(a.flavour, *a.seeds, a.out)
