"""Decoding speed: tokens/s per batch size for HOLA and GDN beside transformers' Llama ``generate``, in one process.

Our rows: a freshly initialised model of ``--size`` (bf16 on CUDA, float32 on a CPU; vocabulary ``--vocab``)
prefills a random prompt of ``--prompt`` tokens per row, then ``hola_titan.eval.generation.generate`` decodes
``--new-tokens`` greedy tokens per row with each ``--decode`` mode (``eager``: every step through the cache
object; ``graph``: a CUDA graph of the step over fixed buffers; ``compile``: the step compiled, then captured;
``hola_titan/decoding.py``). Tokens/s counts the decoding steps after the first token (which comes from the
prefill's logits): ``batch * (steps - 1) / decode seconds``; the decoder's build (warm-up, compilation, capture)
is reported as ``setup_s``, not counted. ``eager`` rows decode ``--eager-new-tokens`` (they are 10-100x slower).

References (``--references``): transformers' ``LlamaForCausalLM`` at 340M (1024 x 24, 8 x 128 heads, SwiGLU 2816,
tied embeddings, SDPA), bf16, ``generate`` greedy with exactly N new tokens, ``llama_dynamic`` with its default
dynamic cache and ``llama_static`` with ``cache_implementation="static"`` (which transformers compiles on CUDA
on the first call: that call is the warm-up). Their decoding rate is ``batch * (N - 1) / (t(N) - t(1))``, the
time of one new token (the prefill) subtracted.

Memory (``--memory-prompts``, first flavour, first non-eager mode, batch 1): after a chunked prefill of each
length and the decoder's build, the memory allocated before decoding and the peak while decoding
``--new-tokens`` (absolute and over that start), which a fixed-size cache keeps constant.

``--profile``: one more decoding step of each of our rows under ``torch.profiler`` (kernel time per step beside
the step time). Prints a table, writes JSON after every row (a run cut short keeps what it measured).

    python scripts/bench_decode.py --flavours hola,gdn --decode eager,graph,compile --batch-sizes 1,8,32,64 \\
        --references llama_dynamic,llama_static --memory-prompts 512,8192 --out decode.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REFERENCES = ("llama_dynamic", "llama_static")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ours(*, flavour, mode, batch, args, device, dtype, model) -> dict:
    from hola_titan.eval.generation import generate

    torch.manual_seed(1)
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), device=device)
    new_tokens = args.eager_new_tokens if mode == "eager" else args.new_tokens
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = generate(model, prompt, max_new_tokens=new_tokens, decode=mode, prefill_chunk=0)
    steps = result.steps - 1
    row = dict(system="hola_titan", flavour=flavour, decode=mode, batch=batch, prompt=args.prompt,
               new_tokens=result.steps, step_ms=1e3 * result.decode_seconds / max(steps, 1),
               tokens_per_s=batch * steps / max(result.decode_seconds, 1e-9),
               setup_s=result.decode_path.get("setup_seconds", 0.0), path=result.decode_path,
               cache_bytes=result.cache.nbytes())
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.profile and mode != "eager":
        from hola_titan.decoding import StaticDecoder
        from hola_titan.profiling import kernel_profile
        decoder = StaticDecoder(model, result.cache, mode=mode)
        token = decoder.greedy_tokens

        def one():
            decoder.step(token)

        prof = kernel_profile(one, device=device, timed_ms=row["step_ms"], iters=4, top=6,
                              label=f"{flavour} {mode} batch {batch}", keep=20)
        row["profile"] = prof
    return row


def _memory(*, flavour, mode, args, device, model) -> list[dict]:
    """Peak memory while decoding after prefills of each length (batch 1)."""
    from hola_titan.decoding import StaticDecoder
    from hola_titan.models.model import ModelCache

    rows = []
    for length in args.memory_prompts:
        torch.manual_seed(2)
        prompt = torch.randint(0, args.vocab, (1, length), device=device)
        cache = ModelCache()
        with torch.inference_mode():
            for start in range(0, length, 2048):  # chunked prefill: the same activations at every length
                model.hidden_states(prompt[:, start:start + 2048], cache=cache)
        decoder = StaticDecoder(model, cache, mode=mode)
        del cache
        gc.collect()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        token = decoder.greedy_tokens
        for _ in range(args.new_tokens):
            decoder.step(token)
        _sync(device)
        rows.append(dict(system="hola_titan", flavour=flavour, decode=mode, batch=1, context=length,
                         cache_bytes=decoder.nbytes(), allocated_before_gib=before / 2**30,
                         decode_peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                         decode_peak_over_before_gib=(torch.cuda.max_memory_allocated(device) - before) / 2**30))
        del decoder
    return rows


def _llama(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=8,
                         head_dim=128, intermediate_size=2816, tie_word_embeddings=True, vocab_size=args.vocab,
                         max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def _reference(name, *, batch, args, device, model) -> dict:
    import transformers

    torch.manual_seed(1)
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(prompt))
    if name == "llama_static":
        kw["cache_implementation"] = "static"

    def run(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        if out.shape[1] != args.prompt + n:
            raise RuntimeError(f"{name}: generate returned {out.shape[1] - args.prompt} new tokens, asked for {n}")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(args.new_tokens)  # warm-up (and, for the static cache, transformers' compilation)
    setup = time.perf_counter() - t0
    full, first = run(args.new_tokens), run(1)
    decode = max(full - first, 1e-9)
    steps = args.new_tokens - 1
    return dict(system="transformers", flavour="llama", decode=name.split("_")[1] + " cache", batch=batch,
                prompt=args.prompt, new_tokens=args.new_tokens, step_ms=1e3 * decode / steps,
                tokens_per_s=batch * steps / decode, setup_s=setup,
                path=dict(transformers=transformers.__version__, cache=name.split("_")[1],
                          compiled=name == "llama_static" and device.type == "cuda"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavours", default="hola,gdn")
    p.add_argument("--size", default="340M")
    p.add_argument("--decode", default="eager,graph,compile", help="comma-separated decode modes")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 64])
    p.add_argument("--eager-batch-sizes", type=_ints, default=None,
                   help="batch sizes of the eager rows (default: --batch-sizes)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--eager-new-tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--backend", default="auto", help="the token mixer's backend (ops.BACKENDS)")
    p.add_argument("--references", default="", help=f"comma-separated: {', '.join(REFERENCES)}")
    p.add_argument("--reference-batch-sizes", type=_ints, default=None, help="default: --batch-sizes")
    p.add_argument("--memory-prompts", type=_ints, default=[])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    args = p.parse_args(argv)

    from hola_titan.models.args import model_args
    from hola_titan.models.model import build_model
    from hola_titan.train import resolve_device

    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = [m for m in args.decode.split(",") if m]
    references = [r for r in args.references.split(",") if r]
    for r in references:
        if r not in REFERENCES:
            p.error(f"--references: unknown {r!r}; expected {', '.join(REFERENCES)}")
    rows, memory = [], []
    meta = dict(date=date.today().isoformat(), device=torch.cuda.get_device_name(device) if device.type == "cuda"
                else "cpu", torch=torch.__version__, size=args.size, prompt=args.prompt, dtype=str(dtype))

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows, memory=memory), indent=1) + "\n")

    def guarded(make, what: str):
        try:
            return make()
        except Exception as exc:  # a row that fails is reported, and the others still run
            print(f"[bench_decode] {what} failed: {type(exc).__name__}: {exc}", flush=True)
            return dict(what=what, error=f"{type(exc).__name__}: {exc}")

    for flavour in [f for f in args.flavours.split(",") if f]:
        model = build_model(model_args(flavour, args.size, vocab_size=args.vocab), device=device,
                            backend=args.backend).to(dtype).eval()
        for mode in modes:
            sizes = args.eager_batch_sizes if mode == "eager" and args.eager_batch_sizes else args.batch_sizes
            for batch in sizes:
                row = guarded(lambda: _ours(flavour=flavour, mode=mode, batch=batch, args=args, device=device,
                                            dtype=dtype, model=model), f"{flavour} {mode} batch {batch}")
                rows.append(row)
                if "error" not in row:
                    print(f"[bench_decode] {flavour} {mode} batch {batch}: {row['tokens_per_s']:,.0f} tokens/s "
                          f"({row['step_ms']:.2f} ms/step, setup {row['setup_s']:.1f} s)", flush=True)
                save()
        if args.memory_prompts and device.type == "cuda" and flavour == args.flavours.split(",")[0]:
            graph_mode = next((m for m in modes if m != "eager"), None)
            if graph_mode is not None:
                got = guarded(lambda: _memory(flavour=flavour, mode=graph_mode, args=args, device=device,
                                              model=model), f"{flavour} memory")
                memory.extend(got if isinstance(got, list) else [got])
                save()
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if references:
        llama = _llama(args, device)
        for name in references:
            for batch in args.reference_batch_sizes or args.batch_sizes:
                row = guarded(lambda: _reference(name, batch=batch, args=args, device=device, model=llama),
                              f"{name} batch {batch}")
                rows.append(row)
                if "error" not in row:
                    print(f"[bench_decode] {name} batch {batch}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
                save()

    print(f"\n{'system':<13}{'flavour':<8}{'decode':<14}{'batch':>6}{'ms/step':>9}{'tokens/s':>11}{'setup s':>9}"
          f"{'kernel ms':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['what']}: {r['error']}")
            continue
        kernel = r.get("profile", {}).get("kernel_ms")
        kernel = f"{kernel:>10.2f}" if isinstance(kernel, (int, float)) else f"{'':>10}"
        print(f"{r['system']:<13}{r['flavour']:<8}{r['decode']:<14}{r['batch']:>6}{r['step_ms']:>9.2f}"
              f"{r['tokens_per_s']:>11,.0f}{r['setup_s']:>9.1f}{kernel}")
    for m in memory:
        if "error" in m:
            print(f"{m['what']}: {m['error']}")
            continue
        print(f"memory {m['flavour']} {m['decode']} context {m['context']:>7}: cache {m['cache_bytes'] / 2**20:.1f} "
              f"MiB, allocated {m['allocated_before_gib']:.3f} GiB, decode peak {m['decode_peak_gib']:.3f} GiB "
              f"(+{m['decode_peak_over_before_gib']:.3f})")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
