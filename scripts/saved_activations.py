"""What one block saves for its backward, by module: the activation-memory breakdown of a training step.

Builds a model of a flavour and size with ``--layers`` blocks on the CPU, runs one forward of one row of
``--seq-len`` tokens under ``torch.autocast(bfloat16)`` (as the trainer's CUDA autocast does) and records every
tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), each storage once, attributed to the leaf
module running then. The token mixer's core (``hola_attention``) is reported as one line: on the CPU it runs the
reference backend, which saves other tensors than the GPU's Triton path. Prints a table and the sum outside the
core, split by a second forward at half the length into what grows with the tokens (scaled to ``--rows`` rows)
and what does not (bf16 copies of weights, once per block), scaled to the size's depth.

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
    # Parameters saved as they are (a hand-written backward may keep the float32 weight and cast it again) are
    # not activation memory.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def measure(seq_len: int):
        seen, nbytes, shapes = set(), collections.Counter(), collections.defaultdict(list)

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key[0] not in params and key not in seen:
                seen.add(key)
                label = core if in_core[0] else running[-1]
                nbytes[label] += t.untyped_storage().nbytes()
                shapes[label].append(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}")
            return t

        tokens = torch.randint(0, margs.vocab_size, (1, seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.hidden_states(tokens)
        return nbytes, shapes

    try:
        nbytes, shapes = measure(args.seq_len)
        half, _ = measure(args.seq_len // 2)
    finally:
        model_module.hola_attention = mixer
        for handle in handles:
            handle.remove()
    print(f"{'module':<48}{'MiB':>9}  saved tensors")
    for label, size in nbytes.most_common():
        print(f"{label:<48}{size / 2**20:>9.1f}  {', '.join(shapes[label][:4])}")
    # What grows with the tokens (activations, per row) and what does not (the weights' bf16 copies, per block),
    # from the same model at T and T / 2.
    # Blocks' lines scale with the depth; the rest (embedding, final norm) is the model's, once.
    def split(counts, in_blocks):
        return sum(size for label, size in counts.items()
                   if label != core and label.startswith("layers.") == in_blocks)

    blocks = depth / args.layers
    total = 0.0
    for in_blocks, where in ((True, f"per {args.layers} block(s)"), (False, "outside the blocks")):
        full, part = split(nbytes, in_blocks), split(half, in_blocks)
        per_row, fixed = 2 * (full - part), 2 * part - full
        times = blocks if in_blocks else 1
        total += (per_row * args.rows + fixed) * times
        print(f"{where}, outside the core: {per_row / 2**20:.1f} MiB per row of {args.seq_len} tokens "
              f"+ {fixed / 2**20:.1f} MiB of weight copies")
    print(f"x {args.rows} rows, {depth} blocks: {total / 2**30:.1f} GiB outside the core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
