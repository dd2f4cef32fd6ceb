"""Decoding with the model's cache: chunked prefill, greedy and sampled generation, decoding memory.

Shape legend: B batch rows, T prompt tokens, V vocabulary.

``generate`` prefills the prompt through a :class:`~hola_titan.models.model.ModelCache` in chunks of
``prefill_chunk`` tokens (the cache object carries the recurrent state, the HOLA cache, the convolution tails or
the Transformer++ keys and values from chunk to chunk), then feeds one token per step. Only the last position's
logits are computed, so no ``[B, T, V]`` tensor is ever built. For HOLA and GDN the cache has a fixed size, so
decoding memory does not grow with the context; :func:`measure_decoding_memory` measures that at several context
lengths.

Sampling: ``temperature == 0`` is greedy (argmax, first index on ties); otherwise logits are divided by the
temperature, cut to the ``top_k`` largest (0: no cut) and then to the smallest set whose probability reaches
``top_p`` (1.0: no cut; the most likely token always stays), and a token is drawn with a generator seeded by
``seed``, so a seed gives the same text on the same device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hola_titan.eval.runtime import EvalError, MemoryProbe, progress
from hola_titan.models.model import HolaTitanLM, ModelCache


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen (module docstring)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature < 0:
            raise EvalError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise EvalError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise EvalError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[B, V]`` with every token outside the top-k / top-p set at ``-inf``."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first token is always kept.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None) -> torch.Tensor:
    """The next token ``[B]`` from last-position logits ``[B, V]``."""
    logits = logits.float()
    if options.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / options.temperature, top_k=options.top_k, top_p=options.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def last_logits(model: HolaTitanLM, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
    """Run ``tokens`` ``[B, t]`` through the model, continuing ``cache``; logits ``[B, V]`` of the last position."""
    hidden = model.hidden_states(tokens, cache=cache)
    return F.linear(hidden[:, -1], model.output_weight())


def prefill(model: HolaTitanLM, prompt: torch.Tensor, cache: ModelCache, *, chunk: int,
            show_progress: bool = False) -> torch.Tensor:
    """Feed ``prompt`` ``[B, T]`` through ``cache`` in chunks of ``chunk`` tokens (0: one call); last logits."""
    seq_len = prompt.shape[1]
    if seq_len == 0:
        raise EvalError("the prompt is empty (generation needs at least one prompt token)")
    step = seq_len if chunk <= 0 else chunk
    starts = range(0, seq_len, step)
    logits = None
    for start in progress(starts, enabled=show_progress and len(starts) > 1, total=len(starts), desc="prefill"):
        logits = last_logits(model, prompt[:, start:start + step], cache)
    return logits


@dataclass
class Generation:
    """Result of :func:`generate`."""

    tokens: list[list[int]]
    """New tokens of each row, cut before the first stop token."""
    cache: ModelCache
    prompt_len: int
    cache_bytes_after_prefill: int
    prefill_seconds: float
    decode_seconds: float
    steps: int
    """Decoding steps the output needed (the longest row, its stop token included). A static decoder looks for stop
    tokens every ``stop_check_every`` steps, so its ``cache`` may have advanced up to that many steps further."""
    finished: list[bool] = field(default_factory=list)
    """Whether each row stopped on a stop token."""
    decode_path: dict = field(default_factory=dict)
    """How the steps ran: ``decode`` (eager, buffers, graph or compile; :mod:`hola_titan.decoding`) and, for a
    static decoder, its ``StaticDecoder.path`` (the token mixer's step, batch size, device, dtype) and
    ``setup_seconds`` (warm-up, compilation and capture, not counted in ``decode_seconds``)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model: HolaTitanLM, prompt: torch.Tensor, *, max_new_tokens: int,
             sampling: SamplingOptions = SamplingOptions(), prefill_chunk: int = 2048,
             stop_ids: tuple[int, ...] | frozenset[int] = (), show_progress: bool = False,
             decode: str = "eager", stop_check_every: int = 16) -> Generation:
    """Continue every row of ``prompt`` (int64 ``[B, T]``, on the model's device) by up to ``max_new_tokens``.

    Rows stop at a token in ``stop_ids`` (not included in the output); decoding ends when every row stopped.
    ``decode``: ``"eager"`` (every step through the cache object), ``"buffers"``, ``"graph"`` or ``"compile"`` (a
    :class:`~hola_titan.decoding.StaticDecoder` of that mode: recurrent flavours; a graph on CUDA), or ``"auto"``
    (:func:`~hola_titan.decoding.resolve_mode`). A static decoder keeps the new tokens on the device and looks
    for stop tokens every ``stop_check_every`` steps (each look waits for the device), so it may run up to that
    many steps past the last row's stop; the output is the same.
    """
    sampling.check()
    from hola_titan.decoding import resolve_mode
    try:
        mode = resolve_mode(decode, model, prompt.device)
    except ValueError as error:
        raise EvalError(str(error)) from None
    if stop_check_every < 1:
        raise EvalError(f"stop_check_every must be >= 1, got {stop_check_every}")
    if prompt.dim() != 2:
        raise EvalError(f"prompt: expected token ids [B, T], got shape {list(prompt.shape)}")
    device = prompt.device
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = ModelCache()
    start = time.perf_counter()
    logits = prefill(model, prompt, cache, chunk=prefill_chunk, show_progress=show_progress)
    _sync(device)
    prefill_seconds = time.perf_counter() - start
    cache_bytes_after_prefill = cache.nbytes()

    if mode != "eager" and max_new_tokens > 1:  # one new token comes from the prefill: no step to run
        return _generate_static(model, logits, cache, mode=mode, max_new_tokens=max_new_tokens, sampling=sampling,
                                generator=generator, stop_ids=frozenset(stop_ids), prompt_len=prompt.shape[1],
                                cache_bytes_after_prefill=cache_bytes_after_prefill,
                                prefill_seconds=prefill_seconds, check_every=stop_check_every,
                                show_progress=show_progress)
    batch = prompt.shape[0]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    stops = frozenset(stop_ids)
    steps = 0
    start = time.perf_counter()
    for step in progress(range(max_new_tokens), enabled=show_progress, total=max_new_tokens, desc="decode"):
        token = next_tokens(logits, sampling, generator)
        steps += 1
        for row, value in enumerate(token.tolist()):
            if done[row]:
                continue
            if value in stops:
                done[row] = True
            else:
                out[row].append(value)
        if all(done) or step == max_new_tokens - 1:
            break
        logits = last_logits(model, token[:, None], cache)
    _sync(device)
    return Generation(tokens=out, cache=cache, prompt_len=prompt.shape[1],
                      cache_bytes_after_prefill=cache_bytes_after_prefill, prefill_seconds=prefill_seconds,
                      decode_seconds=time.perf_counter() - start, steps=steps, finished=done,
                      decode_path={"decode": "eager"})


def _generate_static(model, logits, cache, *, mode, max_new_tokens, sampling, generator, stop_ids, prompt_len,
                     cache_bytes_after_prefill, prefill_seconds, check_every, show_progress) -> Generation:
    """:func:`generate`'s decoding loop on a :class:`~hola_titan.decoding.StaticDecoder`."""
    from hola_titan.decoding import StaticDecoder
    device = logits.device
    start = time.perf_counter()
    decoder = StaticDecoder(model, cache, mode=mode)
    _sync(device)
    setup_seconds = time.perf_counter() - start
    batch = logits.shape[0]
    new = torch.empty(batch, max_new_tokens, dtype=torch.int64, device=device)
    stop_list = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=device)
    steps = 0
    start = time.perf_counter()
    for step in progress(range(max_new_tokens), enabled=show_progress, total=max_new_tokens, desc="decode"):
        token = decoder.greedy_tokens if sampling.greedy and step > 0 else next_tokens(logits, sampling, generator)
        new[:, step] = token
        steps += 1
        last = step == max_new_tokens - 1
        if stop_ids and (last or steps % check_every == 0):
            # Every row has a stop token among its new tokens: nothing further can be kept.
            if bool(torch.isin(new[:, :steps], stop_list).any(dim=1).all()):
                break
        if last:
            break
        logits = decoder.step(token)
    _sync(device)
    decode_seconds = time.perf_counter() - start
    out, done = [], []
    for row in new[:, :steps].tolist():
        cut = next((i for i, value in enumerate(row) if value in stop_ids), None)
        out.append(row if cut is None else row[:cut])
        done.append(cut is not None)
    if all(done):  # the step at which the eager loop would have ended (the look for stops came later)
        steps = max(len(row) + 1 for row in out)
    return Generation(tokens=out, cache=decoder.cache(), prompt_len=prompt_len,
                      cache_bytes_after_prefill=cache_bytes_after_prefill, prefill_seconds=prefill_seconds,
                      decode_seconds=decode_seconds, steps=steps, finished=done,
                      decode_path=dict(decoder.path, setup_seconds=setup_seconds))


def measure_decoding_memory(model: HolaTitanLM, *, lengths: list[int], new_tokens: int, prefill_chunk: int,
                            seed: int = 0, show_progress: bool = False, decode: str = "eager") -> list[dict]:
    """Prefill a random prompt of each length (ascending), decode ``new_tokens`` greedily, and report the cache size
    and the process's peak memory over that stretch (``MemoryProbe``), one dict per length.

    Every length is prefilled in chunks of ``min(prefill_chunk, min(lengths))`` tokens, so that the activations of
    one chunk are the same at every length and the peaks differ only by what grows with the context.
    """
    if not lengths:
        return []
    device = next(model.parameters()).device
    chunk = min(lengths) if prefill_chunk <= 0 else min(prefill_chunk, min(lengths))
    probe = MemoryProbe(device)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for length in progress(sorted(lengths), enabled=show_progress, total=len(lengths), desc="memory"):
        prompt = torch.randint(0, model.args.vocab_size, (1, length), generator=generator).to(device)
        probe.reset()
        before = probe.current_bytes()
        result = generate(model, prompt, max_new_tokens=new_tokens, prefill_chunk=chunk, decode=decode)
        peak = probe.peak_bytes()
        decode_steps = max(result.steps - 1, 1)  # the first new token comes from the prefill's logits
        rows.append({
            "context_len": length,
            "cache_bytes_after_prefill": result.cache_bytes_after_prefill,
            "cache_bytes_after_decode": result.cache.nbytes(),
            "peak_bytes": peak,
            "peak_over_start_bytes": max(peak - before, 0),
            "prefill_seconds": result.prefill_seconds,
            "prefill_tokens_per_s": length / max(result.prefill_seconds, 1e-9),
            "decode_tokens_per_s": decode_steps / max(result.decode_seconds, 1e-9),
            "new_tokens": result.steps,
        })
        del result, prompt
    for row in rows:
        row["peak_measure"] = probe.kind
        row["prefill_chunk"] = chunk
    return rows
