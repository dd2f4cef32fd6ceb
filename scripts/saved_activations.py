"""What one block saves for its backward, by module: the activation-memory breakdown of a training step.

Builds a model of a flavour and size with ``--layers`` blocks on the CPU, runs one forward of one row of
``--seq-len`` tokens under ``torch.autocast(bfloat16)`` (as the trainer's CUDA autocast does) and records every
tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), each storage once, attributed to the leaf
module running then. The token mixer's core (``hola_attention``) is reported as one line: on the CPU it runs the
reference backend, which saves other tensors than the GPU's Triton path. Prints a table and the sum outside the
core, scaled to ``--rows`` rows and the size's depth.

    python scripts/saved_activations.py --flavour hola --size 340M --seq-len 2048 --rows 16
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavour", default="hola")
    p.add_argument("--size", default="340M")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=16, help="rows per step, for the scaled total")
    p.add_argument("--layers", type=int, default=1, help="blocks built (the breakdown is per block)")
    args = p.parse_args(argv)

    import hola_titan.models.model as model_module
    from hola_titan.models.args import model_args
    from hola_titan.models.model import build_model

    torch.manual_seed(0)
    margs = model_args(args.flavour, args.size, vocab_size=8192, n_layers=args.layers)
    depth = model_args(args.flavour, args.size, vocab_size=8192).n_layers
    model = build_model(margs, device="cpu", backend="reference")
    running = ["model"]

    names = {id(module): name for name, module in model.named_modules() if name}

    # Global hooks, not hooks on the modules: a module with its own hooks is run through its call (the MLP folds
    # w2 into its backward otherwise), which would change what is measured.
    def enter(module, inputs):
        if id(module) in names:
            running.append(names[id(module)])

    def leave(module, inputs, output):
        if id(module) in names:
            running.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    core = "hola_attention (reference backend on the CPU)"
    in_core = [False]
    mixer = model_module.hola_attention

    def wrapped(*a, **k):
        in_core[0] = True
        try:
            return mixer(*a, **k)
        finally:
            in_core[0] = False

    model_module.hola_attention = wrapped
    seen, nbytes, shapes = set(), collections.Counter(), collections.defaultdict(list)

    # Parameters saved as they are (a hand-written backward may keep the float32 weight and cast it again) are
    # not activation memory.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key[0] not in params and key not in seen:
            seen.add(key)
            label = core if in_core[0] else running[-1]
            nbytes[label] += t.untyped_storage().nbytes()
            shapes[label].append(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}")
        return t

    tokens = torch.randint(0, margs.vocab_size, (1, args.seq_len))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.hidden_states(tokens)
    finally:
        model_module.hola_attention = mixer
        for handle in handles:
            handle.remove()
    outside = 0
    print(f"{'module':<48}{'MiB':>9}  saved tensors")
    for label, size in nbytes.most_common():
        if label != core:
            outside += size
        print(f"{label:<48}{size / 2**20:>9.1f}  {', '.join(shapes[label][:4])}")
    print(f"outside the core: {outside / 2**20:.1f} MiB per {args.layers} block(s) per {args.seq_len} tokens; "
          f"x {args.rows} rows x {depth // args.layers} = {outside / 2**30 * args.rows * depth / args.layers:.1f} GiB "
          f"(weights' bf16 copies counted per block, not per row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
