"""Whole-model training throughput: hola_titan's flavours through the real ``Trainer`` and two outside references.

For every (flavour, size, seq_len, batch size) it builds a ``Trainer`` (float32 master weights; bf16 compute on
GPU through the trainer's autocast; the chunked head loss), runs ``--warmup`` steps of ``Trainer.train_step``, then
times ``--steps`` steps and reports tokens/s, MFU as the trainer defines it (``flops_per_token * tokens/s`` over
the matmul rate measured on the device, see ``hola_titan/flops.py``), and peak memory; each timed step's own time
is kept too (``step_ms_each``, marked without synchronising) and the table's ``max/med`` column shows the slowest
step over the median, so that one slow step is seen as such. The batches are packed
documents with ``cu_seqlens`` as the trainer's ``data.varlen`` makes them (``--no-packed``: one sequence per
row, as the outside references below are fed). A separate profiling pass
of ``--steps`` steps then times the phases with a device synchronisation after each: forward (``loss_sum``),
backward, and optimizer (clip + AdamW step + zero_grad); its sum is a little above the timed step, since the
synchronisations remove overlap. The chunked head loss computes the head's gradients during its forward, so for
hola_titan rows that work is counted under forward, not backward.

Outside references, in the same process and timed the same way (GPU only; skipped with a message when the
package or a GPU is missing, or with ``--references none``), at the 340M shapes of docs/DESIGN.md §5 with fused
AdamW and no activation checkpointing, under each precision policy of ``--reference-precision``:

- ``bf16_weights``: the model's weights, gradients and optimizer state in bf16 (how fla's and transformers'
  examples train, and how the references were first measured);
- ``fp32_master``: the trainer's policy: float32 weights, gradients and AdamW state, bf16 compute through
  ``torch.autocast``. Rows of this project's trainer are always ``fp32_master`` on a GPU.

The references:

- ``fla_gdn``: flash-linear-attention's ``GatedDeltaNetForCausalLM`` (hidden 1024, 24 layers, 4 heads x 256,
  expand_v 1, no output gate, tied, vocab 32000), eager (fla's ops are ``compiler.disable``);
- ``llama`` and ``llama_compile``: transformers' ``LlamaForCausalLM`` (1024 x 24, 8 x 128 heads, SwiGLU 2816,
  tied, SDPA), eager and under ``torch.compile(model)``.

Every row records its ``precision``. MFU (``mfu``) is the FLOP count (this project's formula, ``gdn`` without gate
for fla's model, ``transformer`` for Llama) over the datasheet dense bf16 peak (989.5 TFLOP/s on an H100 or
H200); ``mfu_measured`` divides by the matmul rate measured in this process at start-up (never cached).

Rows are appended to one JSON list (``--out``), so several calls build one table; the table of this call is
printed at the end. Examples::

    python scripts/bench_train.py --flavours hola,gdn,transformer --sizes 340M --seq-lens 2048,8192 \\
        --batch-sizes 16,4 --steps 10 --warmup 3 --out results.json
    python scripts/bench_train.py --device cpu --sizes debug --seq-lens 64 --batch-sizes 2 --steps 2 --warmup 1 \\
        --references none --out /tmp/bench.json       # a smoke test

``--seq-lens`` and ``--batch-sizes`` pair up position by position when they have the same length (T 2048 with
B 16, T 8192 with B 4); a single value pairs with every value of the other list.

Kernel tuning: Triton caches compiled kernels and, because fla's autotuners run with ``cache_results``
(fla's ``FLA_CACHE_RESULTS``, on by default), the autotuning results too, under ``TRITON_CACHE_DIR``. Pin it to a
folder that survives between calls (``--triton-cache-dir DIR`` sets it before Triton is imported, default
``$TRITON_CACHE_DIR`` or ``~/.triton/cache``) and copy that folder along, so later GPU calls skip the tuning.
fla's ``FLA_CONFIG_DIR`` / ``FLA_CACHE_MODE`` only read pre-tuned configs shipped with fla and are left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = ("fla_gdn", "llama", "llama_compile")
PRECISIONS = ("bf16_weights", "fp32_master")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavours", default="hola,hola_recency,gdn,transformer",
                        help="comma-separated hola_titan flavours; 'none' for references only")
    parser.add_argument("--sizes", default="340M", help="comma-separated sizes (debug, 340M, 1.3B, 7B)")
    parser.add_argument("--seq-lens", default="2048", help="comma-separated sequence lengths")
    parser.add_argument("--batch-sizes", default="16", help="comma-separated rows per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (and profiled steps)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--compile", action="store_true", help="compile.enable for hola_titan models")
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"),
                        help="activation_checkpoint.mode for hola_titan models")
    parser.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                        help="hola_titan rows hold packed documents with cu_seqlens, as the trainer's data.varlen "
                             "feeds them (default); --no-packed: one sequence per row, as the references get")
    parser.add_argument("--float8", action="store_true", help="float8.enable (torchao rowwise) for hola_titan models")
    parser.add_argument("--keep-output", action="store_true",
                        help="also measure each flavour with a HOLA cache under model.save_cache_output true (its "
                             "rows' flavour reads '<flavour>:kept')")
    parser.add_argument("--layered-backward", action="store_true",
                        help="also measure each flavour with a HOLA cache under model.overlap_backward false, the "
                             "layered backward (its rows' flavour reads '<flavour>:layered'; the plain rows run the "
                             "default, the overlapped backward)")
    parser.add_argument("--fa4", action="store_true",
                        help="also measure each flavour with a HOLA cache under model.attention_backend fa4, the "
                             "cache read on FlashAttention-4 (its rows' flavour reads '<flavour>:fa4'; needs "
                             "pip install 'hola-titan[fa4]' on an sm_90 GPU, else the row records why it did not run)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile whole steps (torch.profiler): kernel time against the step's wall time, "
                             "the top kernels, and ATen calls per step (host-bound work)")
    parser.add_argument("--references", default=",".join(REFERENCES),
                        help=f"comma-separated outside references ({', '.join(REFERENCES)}) or 'none'; "
                             "measured at each (seq_len, batch) pair, 340M shapes, GPU only")
    parser.add_argument("--reference-precision", default="bf16_weights,fp32_master",
                        help="comma-separated precision policies of the outside references (bf16_weights, "
                             "fp32_master); each reference is measured under each")
    parser.add_argument("--profile-keep", type=int, default=200,
                        help="with --profile, how many kernels (by time) each row's JSON keeps")
    parser.add_argument("--vocab-size", type=int, default=32000, help="vocabulary (a synthetic tokenizer)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=Path("results.json"), help="JSON list to append rows to")
    parser.add_argument("--triton-cache-dir", default=None, help="sets TRITON_CACHE_DIR before Triton loads")
    parser.add_argument("--kernel-configs", default="auto",
                        help="fla's launch configurations (model.kernel_configs: auto, off or a file), for our rows "
                             "and the references alike")
    parser.add_argument("--compare-autotuned", action="store_true",
                        help="after the rows, forget every configuration, autotune every fla kernel afresh and "
                             "measure the same rows again in this process (the tuned files' cost in tokens/s)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip() and item.strip() != "none"]


def _shape_pairs(seq_lens: list[int], batch_sizes: list[int]) -> list[tuple[int, int]]:
    if len(seq_lens) == len(batch_sizes):
        return list(zip(seq_lens, batch_sizes))
    if len(seq_lens) == 1:
        return [(seq_lens[0], b) for b in batch_sizes]
    if len(batch_sizes) == 1:
        return [(t, batch_sizes[0]) for t in seq_lens]
    raise SystemExit("error: --seq-lens and --batch-sizes must have the same length, or one of them one value")


def _write_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of ``vocab_size`` ids (the benchmark feeds random ids; only the size matters)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer(WordLevel(vocab, unk_token="t1")).save(str(folder / "tokenizer.json"))
    return folder


class _Clock:
    """Wall time with a device synchronisation at both ends."""

    def __init__(self, device):
        self.device = device

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def mark(self):
        """A point in the device's work without a synchronisation: a recorded CUDA event (on the CPU, the wall
        time), so that marking every step leaves the steps' overlap as the training loop has it."""
        import torch

        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        """Seconds from mark ``a`` to mark ``b`` (both recorded and, on CUDA, completed)."""
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _random_batch(batch_size: int, seq_len: int, vocab_size: int, generator, packed: bool = False) -> dict:
    """Random tokens on the host, as the data loader yields them (the trainer moves them to the device);
    ``packed``: every row also holds documents of random lengths (3 random cuts per row, the trainer's
    ``data.varlen`` layout, ``cu_seqlens`` over the flattened rows)."""
    import torch

    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if packed:
        cuts = {0, batch_size * seq_len}
        for row in range(batch_size):
            cuts.add(row * seq_len)
            cuts.update(row * seq_len + int(c) for c in torch.randint(1, max(2, seq_len), (3,), generator=generator))
        batch["cu_seqlens"] = torch.tensor(sorted(cuts), dtype=torch.int32)
    return batch


def _measure(*, step, phases, clock, device, tokens_per_step: int, steps: int, warmup: int,
             profile: bool = False, profile_keep: int = 200) -> dict:
    """Warm up, time ``steps`` calls of ``step``, then profile ``steps`` calls of the three ``phases`` (and, with
    ``profile``, ``steps`` whole steps under ``torch.profiler``)."""
    from hola_titan.metrics import peak_memory_gib

    for i in range(warmup):
        t0 = clock.now()
        step()
        # The first steps compile and (on a fresh machine, per new dtype/shape key) autotune kernels: minutes.
        print(f"  warm-up step {i + 1}: {clock.now() - t0:.1f} s", flush=True)
    _reset_peak(device)
    start = clock.now()
    marks = [clock.mark()]
    for _ in range(steps):
        step()
        marks.append(clock.mark())
    elapsed = clock.now() - start
    # Each timed step's own time, so that one slow step (a late compilation, a host stall) shows as itself
    # rather than only in the mean.
    each = [1e3 * clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
    peak = peak_memory_gib(device)
    totals = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for _ in range(steps):
        forward, backward, optimizer = phases
        t0 = clock.now()
        loss = forward()
        t1 = clock.now()
        backward(loss)
        t2 = clock.now()
        optimizer()
        t3 = clock.now()
        totals["forward"] += t1 - t0
        totals["backward"] += t2 - t1
        totals["optimizer"] += t3 - t2
    median = statistics.median(each)
    row = {"tokens_per_s": tokens_per_step * steps / elapsed, "step_ms": 1e3 * elapsed / steps,
           "step_ms_each": each, "step_ms_median": median, "step_max_over_median": max(each) / median,
           "peak_memory_gib": peak}
    row.update({f"{name}_ms": 1e3 * value / steps for name, value in totals.items()})
    if profile:
        from hola_titan.profiling import kernel_profile
        row["profile"] = kernel_profile(step, device=device, timed_ms=row["step_ms"], iters=steps, top=25,
                                        label="training step", keep=profile_keep)
    return row


CACHE_FLAVOURS = ("hola", "hola_recency")  # the flavours with a HOLA cache read
# A row's variant (``<flavour>:<variant>``): the flag that adds such rows, the setting and the value its rows give
# it. Both settings act on the Triton backend's cache read, so both need a CUDA device and a cache flavour. The
# plain rows leave both settings at the trainer's defaults.
VARIANTS = {"kept": ("keep_output", "model.save_cache_output", "true"),
            "layered": ("layered_backward", "model.overlap_backward", "false"),
            "fa4": ("fa4", "model.attention_backend", "fa4")}


def _flavour_rows(args, device) -> list[str]:
    """The rows' flavour names, each once: ``--flavours`` in order, then with ``--keep-output`` each cache flavour
    again as ``<flavour>:kept``, with ``--layered-backward`` as ``<flavour>:layered``, with ``--fa4`` as
    ``<flavour>:fa4``. A suffix other than these,
    or variant rows that cannot run (no cache flavour, no CUDA device for the Triton backend), stop the script
    before any row is measured."""
    names = list(dict.fromkeys(_split(args.flavours)))
    for name in names:
        flavour, colon, variant = name.partition(":")
        if colon and (variant not in VARIANTS or flavour not in CACHE_FLAVOURS):
            raise SystemExit(f"error: --flavours: {name!r}: the variants are "
                             f"{', '.join(':' + v for v in VARIANTS)}, of {', '.join(CACHE_FLAVOURS)}")
    for variant, (attr, key, _) in VARIANTS.items():
        if not getattr(args, attr):
            continue
        flag = "--" + attr.replace("_", "-")
        if device.type != "cuda":
            raise SystemExit(f"error: {flag}: {key} needs the Triton backend (a CUDA device)")
        added = [f"{name}:{variant}" for name in names if name in CACHE_FLAVOURS]
        if not added and not any(name.endswith(f":{variant}") for name in names):
            raise SystemExit(f"error: {flag}: none of --flavours has a cache read ({', '.join(CACHE_FLAVOURS)})")
        names = list(dict.fromkeys(names + added))
    return names


def bench_hola_titan(*, flavour: str, size: str, seq_len: int, batch_size: int, args, tokenizer_dir: Path,
                     dump: Path) -> dict:
    """One row for a hola_titan flavour, through ``Trainer.train_step`` (and its ``loss_sum`` for profiling);
    ``<flavour>:kept``: the flavour with ``model.save_cache_output`` true; ``<flavour>:layered``: with
    ``model.overlap_backward`` false."""
    import torch

    from hola_titan.config import parse_config
    from hola_titan.train import IGNORE_INDEX, Trainer

    label = flavour
    flavour, _, variant = label.partition(":")
    # A variant's setting given for its own rows only; the others keep the trainer's defaults.
    overrides = ["--" + VARIANTS[variant][1], VARIANTS[variant][2]] if variant else []
    overrides += ["--model.flavour", flavour, "--model.size", size, "--model.tokenizer_path", str(tokenizer_dir),
                  "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch_size),
                  "--training.steps", str(10 * (args.warmup + 2 * args.steps) + 10),
                  "--training.device", args.device, "--training.mixed_precision_param",
                  "float32" if args.device == "cpu" else "bfloat16",
                  "--activation_checkpoint.mode", args.ac, "--compile.enable", str(args.compile).lower(),
                  "--validation.enable", "false", "--checkpoint.enable", "false",
                  "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump),
                  "--data.dataset", "bundled", "--lr_scheduler.warmup_steps", "1",
                  "--float8.enable", str(args.float8).lower(), "--model.kernel_configs", args.kernel_configs]
    t0 = time.time()
    trainer = Trainer(parse_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
                                    *overrides]))
    print(f"{label} {size} T={seq_len} B={batch_size}: trainer built in {time.time() - t0:.1f} s", flush=True)
    device = trainer.device
    clock = _Clock(device)
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.model_args.vocab_size
    batch = _random_batch(batch_size, seq_len, vocab, generator, packed=args.packed)
    scale = 1.0 / (batch_size * seq_len)

    def step():
        # As the training loop does between log steps: the step's numbers stay on the device (the next step's
        # optimizer update reads them); _Clock's synchronisations bound the timed window.
        trainer.train_step([batch])

    def forward():
        return trainer.loss_sum(batch)

    def backward(loss):
        (loss * scale).backward()

    def optimizer():
        trainer.clip_grad_norm()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    assert int((batch["labels"] == IGNORE_INDEX).sum()) == 0
    row = _measure(step=step, phases=(forward, backward, optimizer), clock=clock, device=device,
                   tokens_per_step=batch_size * seq_len, steps=args.steps, warmup=args.warmup, profile=args.profile,
                   profile_keep=args.profile_keep)
    flops = trainer.flops["total"]
    row.update(system="hola_titan", flavour=label, size=size,
               save_cache_output=trainer.config.model.save_cache_output,
               # what ran, from the paths line (the setting does not apply to every flavour and device)
               overlap_backward="overlapped backward" in trainer.paths.get("attention_backend", ""),
               num_params=trainer.num_params,
               mfu=flops * row["tokens_per_s"] / (trainer.peak_tflops * 1e12),
               mfu_measured=flops * row["tokens_per_s"] / (trainer.measured_tflops * 1e12),
               flops_per_token=flops, compile=args.compile, ac=args.ac, float8=args.float8, packed=args.packed,
               precision="fp32_master" if trainer.autocast else "float32", paths=trainer.paths,
               kernel_configs=trainer.kernel_configs.record())
    trainer = None  # free it before the next row (the closures above hold no other reference)
    return row


def _reference_model(name: str, vocab_size: int):
    """The outside reference ``name`` at 340M shapes, and the hola_titan ModelArgs with the same FLOPs."""
    from hola_titan.models.args import model_args

    if name == "fla_gdn":
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        config = GatedDeltaNetConfig(hidden_size=1024, num_hidden_layers=24, num_heads=4, head_dim=256,
                                     expand_v=1, use_gate=False, tie_word_embeddings=True, vocab_size=vocab_size,
                                     fuse_cross_entropy=True)
        flops_args = replace(model_args("gdn", "340M", vocab_size=vocab_size), use_gate=False)
        return GatedDeltaNetForCausalLM(config), flops_args
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=8,
                         head_dim=128, intermediate_size=2816, tie_word_embeddings=True, vocab_size=vocab_size,
                         max_position_embeddings=32768, attn_implementation="sdpa")
    flops_args = replace(model_args("transformer", "340M", vocab_size=vocab_size), n_heads=8, head_dim=128,
                         mlp_hidden=2816)
    return LlamaForCausalLM(config), flops_args


def bench_reference(*, name: str, precision: str, seq_len: int, batch_size: int, args, device,
                    measured_tflops: float) -> dict:
    """One row for an outside reference under ``precision`` (see the module docstring): fused AdamW,
    ``model(ids, labels=...).loss``."""
    import torch

    from hola_titan.flops import flops_per_token, mfu_peak

    torch.manual_seed(0)
    model, flops_args = _reference_model(name, args.vocab_size)
    model = model.to(device=device, dtype=torch.bfloat16 if precision == "bf16_weights" else torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    run = torch.compile(model) if name == "llama_compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    clock = _Clock(device)
    autocast = (partial(torch.autocast, "cuda", dtype=torch.bfloat16) if precision == "fp32_master"
                else contextlib.nullcontext)

    def forward():
        with autocast():
            return run(input_ids=tokens, labels=tokens).loss

    guard = contextlib.nullcontext
    if name == "fla_gdn":
        # fla 0.6.0 refuses this backward on Hopper with Triton < 3.7.1 (its issue #640). The same explicit
        # handling as our own GDN path: a gradient check on this GPU first, then the guard lifted per call.
        from hola_titan.kernels.gdn import fla_bridge

        fla_bridge.prepare_backward(256, device)
        guard = partial(fla_bridge.fla_backward_allowed, fla_bridge.padded_head_dim(256, device), device)

    def backward(loss):
        with guard():
            loss.backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        loss = forward()
        backward(loss)
        optimizer()

    row = _measure(step=step, phases=(forward, backward, optimizer), clock=clock, device=device,
                   tokens_per_step=batch_size * seq_len, steps=args.steps, warmup=args.warmup, profile=args.profile,
                   profile_keep=args.profile_keep)
    flops = flops_per_token(flops_args, seq_len)["total"]
    peak, _ = mfu_peak(device, measured_tflops)
    row.update(system=name, flavour=name, size="340M", num_params=num_params, flops_per_token=flops,
               mfu=flops * row["tokens_per_s"] / (peak * 1e12),
               mfu_measured=flops * row["tokens_per_s"] / (measured_tflops * 1e12),
               compile=name == "llama_compile", ac="none", precision=precision)
    model = run = opt = None  # free them before the next row
    return row


def _reference_skip_reason(device, names: list[str]) -> dict[str, str]:
    """Why each requested reference cannot run here (absent: it can)."""
    reasons = {}
    for name in names:
        if name not in REFERENCES:
            raise SystemExit(f"error: --references: unknown {name!r}; expected some of {', '.join(REFERENCES)}")
        if device.type != "cuda":
            reasons[name] = "no GPU (the references are timed with bf16 weights and GPU kernels)"
            continue
        # fla-core (this project's dependency) ships the kernels only; the models are in the full
        # flash-linear-attention package.
        module, package = ("fla.models", "flash-linear-attention") if name == "fla_gdn" else ("transformers",
                                                                                               "transformers")
        try:
            __import__(module)
        except ImportError as err:
            reasons[name] = f"{module} cannot be imported: install the {package} package ({err})"
    return reasons


def _print_table(rows: list[dict]) -> None:
    # Column widths from the rows: reference names (llama_compile) are longer than ours.
    ws = max([13] + [len(str(r["system"])) + 2 for r in rows])
    wf = max([14] + [len(str(r["flavour"])) + 2 for r in rows])
    header = (f"{'system':<{ws}}{'flavour':<{wf}}{'size':<6}{'T':>6}{'B':>4}{'params':>9}{'tok/s':>11}{'MFU':>7}"
              f"{'mem GiB':>9}{'step ms':>9}{'max/med':>8}{'fwd':>8}{'bwd':>8}{'opt':>7}  precision, note")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<{ws}}{r['flavour']:<{wf}}{r['size']:<6}{r['seq_len']:>6}{r['batch_size']:>4}"
                  f"  {r['error']}")
            continue
        note = ",".join(n for n, on in ((r.get("precision", "?"), True), ("compile", r.get("compile")),
                                        (f"ac={r.get('ac')}", r.get("ac") != "none"), ("float8", r.get("float8")),
                                        ("unpacked", r.get("packed") is False),
                                        ("autotuned", r.get("kernel_configs_pass") == "off"))
                        if on)
        print(f"{r['system']:<{ws}}{r['flavour']:<{wf}}{r['size']:<6}{r['seq_len']:>6}{r['batch_size']:>4}"
              f"{r['num_params'] / 1e6:>8.1f}M{r['tokens_per_s']:>11,.0f}{100 * r['mfu']:>6.1f}%"
              f"{r['peak_memory_gib']:>9.2f}{r['step_ms']:>9.1f}{r.get('step_max_over_median', float('nan')):>8.2f}"
              f"{r['forward_ms']:>8.1f}{r['backward_ms']:>8.1f}"
              f"{r['optimizer_ms']:>7.1f}  {note}")


def _append(out: Path, rows: list[dict]) -> None:
    existing = json.loads(out.read_text()) if out.exists() and out.read_text().strip() else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(existing + rows, indent=1) + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.triton_cache_dir:
        os.environ["TRITON_CACHE_DIR"] = str(Path(args.triton_cache_dir).resolve())
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    sys.path.insert(0, str(ROOT))
    import torch

    from hola_titan.metrics import setup_logging
    from hola_titan.train import resolve_device

    setup_logging(0)
    device = resolve_device(args.device)
    args.device = device.type
    pairs = _shape_pairs([int(t) for t in _split(args.seq_lens)], [int(b) for b in _split(args.batch_sizes)])
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}",
             "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup}
    references = _split(args.references)
    skipped = _reference_skip_reason(device, references)
    precisions = _split(args.reference_precision)
    for precision in precisions:
        if precision not in PRECISIONS:
            raise SystemExit(f"error: --reference-precision: unknown {precision!r}; expected some of "
                             f"{', '.join(PRECISIONS)}")
    measured_tflops = 0.0
    if references and len(skipped) < len(references):
        from hola_titan.flops import measured_matmul_tflops
        measured_tflops = measured_matmul_tflops(device)
    if device.type == "cuda" and references:
        from hola_titan.kernels.runtime.tuned_configs import install
        installed = install(args.kernel_configs, device)  # the references' fla kernels (our rows install their own)
        print(f"fla kernel configurations: {installed.describe()}", flush=True)
    rows = []
    passes = [args.kernel_configs] + (["off"] if args.compare_autotuned else [])
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        tokenizer_dir = _write_tokenizer(Path(tmp) / "tokenizer", args.vocab_size)
        flavours = _flavour_rows(args, device)
        jobs = [("ours", flavour, size, t, b) for size in _split(args.sizes) for flavour in flavours
                for t, b in pairs]
        jobs += [(f"ref:{precision}", name, "340M", t, b) for name in references if name not in skipped
                 for precision in precisions for t, b in pairs]
        for index, (configs, (kind, name, size, seq_len, batch_size)) in enumerate(
                [(c, job) for c in passes for job in jobs]):
            if index == len(jobs) and len(passes) > 1:
                from hola_titan.kernels.runtime.tuned_configs import uninstall
                uninstall()  # every fla autotuner starts empty: the second pass tunes everything itself
            args.kernel_configs = configs
            base = dict(stamp, seq_len=seq_len, batch_size=batch_size, kernel_configs_pass=configs)
            try:
                if kind == "ours":
                    row = bench_hola_titan(flavour=name, size=size, seq_len=seq_len, batch_size=batch_size,
                                           args=args, tokenizer_dir=tokenizer_dir, dump=Path(tmp) / "run")
                else:
                    row = bench_reference(name=name, precision=kind.split(":", 1)[1], seq_len=seq_len,
                                          batch_size=batch_size, args=args, device=device,
                                          measured_tflops=measured_tflops)
            except torch.OutOfMemoryError:
                row = {"system": "hola_titan" if kind == "ours" else name, "flavour": name, "size": size,
                       "error": "out of memory"}
            rows.append({**base, **row})
            _append(args.out, rows[-1:])  # row by row: a run stopped by a time limit keeps what it measured
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"done: {rows[-1]['system']} {name} {size} T={seq_len} B={batch_size}: "
                  f"{rows[-1].get('tokens_per_s', rows[-1].get('error'))} tokens/s", flush=True)
    _print_table(rows)
    for name, reason in skipped.items():
        print(f"reference models skipped: {name}: {reason}")
    print(f"appended {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
