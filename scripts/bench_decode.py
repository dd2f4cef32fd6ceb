"""Decoding speed through the cache: tokens/s and ATen calls per step, per flavour and token-mixer backend.

For each flavour, a freshly initialised model of ``--size`` (bf16 on CUDA, float32 on the CPU) prefills a random
prompt of ``--prompt`` tokens, then decodes ``--steps`` single tokens (batch ``--batch``) with
``model.hidden_states(token, cache=...)``, timed after ``--warmup`` steps; one more step runs under
``torch.profiler`` (``scripts/profiling.py``) for the ATen calls per step and, on CUDA, the kernel time.
``--backends auto,reference`` compares the one-token path (``kernels/hola_decode.py``, taken by ``auto``) with the
reference backend's blocked continuation. Prints a table and writes JSON.

    python scripts/bench_decode.py --flavours hola,gdn --size 340M --backends auto,reference --out decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavours", default="hola,gdn")
    p.add_argument("--size", default="340M")
    p.add_argument("--backends", default="auto,reference")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    args = p.parse_args(argv)

    from hola_titan.profiling import kernel_profile

    from hola_titan.models.args import model_args
    from hola_titan.models.model import ModelCache, build_model
    from hola_titan.train import resolve_device

    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for flavour in args.flavours.split(","):
        for backend in args.backends.split(","):
            torch.manual_seed(0)
            model = build_model(model_args(flavour, args.size, vocab_size=8192), device=device,
                                backend=backend).to(dtype).eval()
            tokens = torch.randint(0, 8192, (args.batch, args.prompt + args.warmup + args.steps + 1), device=device)
            cache = ModelCache()
            position = [args.prompt]

            def step():
                model.hidden_states(tokens[:, position[0]:position[0] + 1], cache=cache)
                position[0] += 1

            with torch.no_grad():
                model.hidden_states(tokens[:, :args.prompt], cache=cache)
                for _ in range(args.warmup):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                per_step = (time.perf_counter() - t0) / args.steps
                prof = kernel_profile(step, device=device, timed_ms=1e3 * per_step, iters=1, top=5,
                                      label=f"{flavour} {backend} decode step")
            rows.append(dict(flavour=flavour, backend=backend, size=args.size, device=str(device),
                             dtype=str(dtype).replace("torch.", ""), batch=args.batch, prompt=args.prompt,
                             step_ms=1e3 * per_step, tokens_per_s=args.batch / per_step,
                             aten_calls_per_step=prof["aten_calls"], profile=prof))
            model = cache = None  # free them before the next flavour
    print(f"\n{'flavour':<14}{'backend':<11}{'step ms':>9}{'tokens/s':>10}{'ATen calls':>12}")
    for r in rows:
        print(f"{r['flavour']:<14}{r['backend']:<11}{r['step_ms']:>9.1f}{r['tokens_per_s']:>10.1f}"
              f"{r['aten_calls_per_step']:>12,}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
