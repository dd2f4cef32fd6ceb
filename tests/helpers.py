"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from hola_titan.models.args import model_args, replace
from hola_titan.models.model import HolaTitanLM, build_model


def tiny_model(flavour: str, *, vocab_size: int = 97, seed: int = 0, **changes) -> HolaTitanLM:
    """The debug flavour with block 4 and window 3, so 20-odd tokens cross several blocks and cache merges.

    After the standard init the cache parameters are moved off their init values (gate -4 would scale the
    cache path by 0.018 and hide its errors; gammas of 1 and sink 0 would hide a missing norm weight or sink).
    ``changes``: other :class:`ModelArgs` fields (the layer's open choices).
    """
    args = replace(model_args(flavour, "debug", vocab_size=vocab_size), block=4, window=3, **changes)
    torch.manual_seed(seed)
    model = build_model(args, device="cpu")
    if flavour in ("hola", "hola_recency"):
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for block in model.layers.values():
                mixer = block.attn
                mixer.gate.copy_(0.5 + 0.5 * torch.randn(mixer.gate.shape, generator=gen))
                mixer.sink.copy_(torch.randn(mixer.sink.shape, generator=gen))
                mixer.gamma_q.copy_(1 + 0.2 * torch.randn(mixer.gamma_q.shape, generator=gen))
                mixer.gamma_k.copy_(1 + 0.2 * torch.randn(mixer.gamma_k.shape, generator=gen))
    return model.eval()


ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/NAME.py`` imported as module ``NAME`` (registered first: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_parallel_worker(out: Path, nproc: int, args: list[str], *, timeout: float = 600) -> dict:
    """``torchrun`` ``nproc`` processes of ``tests/parallel_worker.py`` with the config overrides ``args``;
    returns rank 0's ``result.pt`` (losses, gradient norms, gradients of step 1)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOLA_TITAN_CACHE=str(out / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(ROOT / "tests" / "parallel_worker.py"), str(out), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return torch.load(out / "result.pt")


def run_parallel_runs(out: Path, nproc: int, runs: dict[str, list[str]], *,
                      timeout: float = 600) -> dict[str, dict | str]:
    """One ``torchrun`` of ``nproc`` processes of ``tests/parallel_worker.py`` that trains ``runs`` (name -> config
    overrides) one after another. Returns name -> rank 0's ``result.pt`` for each run that finished; where the
    launch failed, the runs without a result map to a report of the failure instead (the run it failed in, the
    exit status and the output's end), for the test of that run to show."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOLA_TITAN_CACHE=str(out / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(ROOT / "tests" / "parallel_worker.py"), str(out), "--runs",
           str(out / "runs.json")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results: dict[str, dict | str] = {name: torch.load(out / name / "result.pt") for name in runs
                                      if (out / name / "result.pt").exists()}
    started = re.findall(r"^parallel_worker: run (\S+)$", result.stdout, flags=re.M)
    report = (f"torchrun of {nproc} processes exited with {result.returncode} in run "
              f"{started[-1] if started else '(none started)'}:\n{result.stdout[-3000:]}{result.stderr[-5000:]}")
    for name in runs:
        results.setdefault(name, report)
    return results


def flat_cache(cache) -> list[torch.Tensor]:
    """Every tensor of a recurrent model's ``ModelCache``, layer by layer (tails, state, then the HOLA cache)."""
    from hola_titan.decoding import flatten_layer
    return [t for layer in cache.layers.values() for t in flatten_layer(layer)]


# float32 unit roundoff (half an ulp of 1.0): the relative error of one correctly rounded operation.
U32 = 2.0 ** -24
# Roundoff units allowed on top of twice the plain-PyTorch error (see assert_fp32_close): the terms of a sum are
# products and exponentials that carry a few units each, and a sum of n terms in an unknown order adds about
# sqrt(n) units of its absolute terms (n is at most a few hundred here); the errors seen are 1 to 4 units.
FP32_FLOOR_UNITS = 16
# Runs of a float32 model at nearby weights (``nudge_weights``) that measure plain PyTorch's error on a whole
# model's parameter gradients, with the plain run: one run's error on a gradient that sums every token with
# cancellation (the decays' A_log and dt_bias, the sinks) is one draw of a wide distribution. Over 12 token draws
# of the debug model, one run's relative error on A_log ran from 2 to 52 roundoff units, and the fused kernels'
# from 8 to 137 with the same median: on one CPU a lucky draw failed them at 1.5x "twice the plain error". With
# the largest error over the plain and seven nudged runs, the worst of 24 draws (both flavours) was 0.64.
NUDGED_RUNS = 7


class Launches:
    """Stands in for a Triton kernel and counts its launches (``kernel[grid](...)``): tests that a launch choice
    took the kernels it names, not another path with the same results."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def nudge_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Move every floating-point weight of ``model`` in place by at most one ulp (up, down or not at all, drawn
    from ``seed``): a point as close to the original as the dtype allows, at which plain PyTorch's rounding
    errors are a fresh draw."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            step = torch.randint(-1, 2, p.shape, generator=gen)
            up, down = (torch.nextafter(p, torch.full_like(p, x)) for x in (float("inf"), float("-inf")))
            p.copy_(torch.where(step > 0, up, torch.where(step < 0, down, p)))
    return model


def model_grads(args, tokens: torch.Tensor, cu: torch.Tensor | None, kernels: str, dtype: torch.dtype,
                nudge: int | None = None) -> tuple[torch.Tensor, dict]:
    """Logits and parameter gradients (of the mean squared logit) of the model ``args`` describes on the reference
    backend with ``kernels``, from seed 0's weights in ``dtype``, moved by :func:`nudge_weights` (``nudge``) where
    given."""
    torch.manual_seed(0)
    model = HolaTitanLM(args, backend="reference", kernels=kernels)
    model.init_weights()
    model.to(dtype)
    if nudge is not None:
        nudge_weights(model, nudge)
    logits = model(tokens, cu_seqlens=cu)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def token_abs_terms(out: torch.Tensor, weight: torch.Tensor, params: list[torch.Tensor], *,
                    batched: bool = True) -> list[torch.Tensor | None]:
    """The sums of absolute terms of parameter gradients that are reductions over tokens.

    ``out`` ``[B, T, ...]`` (float64, still attached to ``params``), ``weight`` its weight in the loss
    ``sum(out * weight)``: for each parameter (shared by every token: per head, per channel), the sum over the
    tokens of |token t's contribution to the gradient|, i.e. the gradient with ``weight`` kept at token t only.
    ``batched``: one backward over every token at once (``is_grads_batched``, needs a vmap-able backward), else
    one backward per token."""
    b, t = out.shape[:2]
    n = b * t
    masks = torch.eye(n, dtype=out.dtype).view(n, b, t, *([1] * (out.dim() - 2))) * weight.to(out.dtype)
    if batched:
        grads = torch.autograd.grad(out, params, masks, is_grads_batched=True, retain_graph=True, allow_unused=True)
        return [None if g is None else g.abs().sum(0) for g in grads]
    sums = [None] * len(params)
    for mask in masks:
        for i, g in enumerate(torch.autograd.grad(out, params, mask, retain_graph=True, allow_unused=True)):
            if g is not None:
                sums[i] = g.abs() if sums[i] is None else sums[i] + g.abs()
    return sums


def _fp32_parts(reference, exact, abs_terms):
    r, e = reference.detach().double(), exact.detach().double()
    if not e.numel():
        return 0.0, 0.0
    scale = (abs_terms if abs_terms is not None else e).detach().double().abs().max().item()
    return (r - e).abs().max().item(), scale


def fp32_error_bound(reference: torch.Tensor, exact: torch.Tensor, abs_terms: torch.Tensor | None = None) -> float:
    """The bound of ``assert_fp32_close``: twice the max-abs error of ``reference`` (the computation in plain
    PyTorch float32) against ``exact`` (float64), plus FP32_FLOOR_UNITS roundoff units of the absolute terms
    (``abs_terms``' largest value for reductions over tokens, else the tensor's largest magnitude)."""
    err_ref, scale = _fp32_parts(reference, exact, abs_terms)
    return 2 * err_ref + FP32_FLOOR_UNITS * U32 * scale


def assert_fp32_close(actual: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, what: str, *,
                      abs_terms: torch.Tensor | None = None) -> None:
    """``actual`` (float32, the computation under test) within ``fp32_error_bound`` of ``exact`` (float64).

    The bound follows from the arithmetic, not from the tensor's magnitude: a gradient that sums contributions of
    every token with cancellation (a sink's) is off by roundoff units of its absolute terms, which can be many
    units of its value; and the plain-PyTorch float32 run measures what its own summation order costs."""
    a, e = actual.detach().double(), exact.detach().double()
    assert a.shape == e.shape, f"{what}: shape {list(a.shape)} vs {list(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN (unwritten output?)"
    err = (a - e).abs().max().item() if e.numel() else 0.0
    err_ref, scale = _fp32_parts(reference, exact, abs_terms)
    bound = 2 * err_ref + FP32_FLOOR_UNITS * U32 * scale
    assert err <= bound, (f"{what}: max abs error {err:.3e} against float64 > {bound:.3e} = 2 x {err_ref:.3e} "
                          f"(float32 PyTorch) + {FP32_FLOOR_UNITS} u x {scale:.3e} (absolute terms or scale)")


def hola_inputs(batch: int, seq_len: int, heads: int, dim: int, *, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random leaves of a ``hola_attention`` call on the CPU (q, k, v, a decay, beta, the cache path's gammas, sink
    and gate), drawn from ``seed`` and requiring gradients."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=randn(batch, seq_len, heads, dim), k=randn(batch, seq_len, heads, dim),
             v=randn(batch, seq_len, heads, dim),
             g=-F.softplus(randn(batch, seq_len, heads)) * 0.5, beta=torch.sigmoid(randn(batch, seq_len, heads)),
             gamma_q=1 + 0.3 * randn(dim), gamma_k=1 + 0.3 * randn(dim), sink=randn(heads), gate=randn(heads))
    return {n: t.to(dtype).requires_grad_() for n, t in x.items()}


def fresh_leaves(x: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Detached copies of ``x`` (in ``dtype`` if given) that require gradients."""
    return {n: t.detach().to(dtype or t.dtype).clone().requires_grad_() for n, t in x.items()}
