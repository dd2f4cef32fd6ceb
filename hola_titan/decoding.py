"""Fast decoding of the recurrent flavours: the one-token step over a cache held in fixed buffers.

Shape legend: B batch rows, V vocabulary.

HOLA, HOLA+recency and GDN carry a cache of fixed size (convolution tails, the recurrent state, the HOLA top-W
entries and unfinished block), and one token's step through it has static shapes and no host synchronisation
(``hola_titan/kernels/hola/decode.py``). So the whole step can run from fixed buffers: :class:`StaticDecoder` copies a
prefilled :class:`~hola_titan.models.model.ModelCache` into buffers it owns, and every :meth:`StaticDecoder.step`
computes the model's step from them and writes the new cache back in place. Three ways to run that step, named
by ``mode`` and recorded in :attr:`StaticDecoder.path`:

* ``"buffers"``: the step as PyTorch runs it, one kernel launch per operation (about 200 per layer; on a GPU the
  host's launch rate bounds it, docs/LOG.md);
* ``"graph"``: the same step captured once in a CUDA graph and replayed (one launch per token);
* ``"compile"``: each block's step compiled by ``torch.compile`` (Inductor fuses the elementwise work of the
  norms, gates, convolutions and the cache read; one graph serves every block), then the whole step captured in a
  CUDA graph.

Every mode computes the arithmetic of the model's own step through its cache object (``"eager"`` decoding,
``hola_titan.eval.generation``): ``"buffers"`` and ``"graph"`` bit for bit. ``"compile"`` rounds bf16
intermediates where eager does (Inductor's ``emulate_precision_casts``: without it the fused convolution kept
q, k, v in float32, the scores moved by about 1e-3 and top-W selections flipped), so it differs only in the order
of float32 sums (tests/test_decoding_gpu.py bounds it). A CUDA graph is made for one batch size: a decoder
serves the batch its cache holds.

Why not the Transformer++ flavour: its keys and values grow with the context, so its step has a new shape every
token; it decodes eagerly (``hola_titan.eval.generation``).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from hola_titan.models.context import NO_CONTEXT
from hola_titan.models.model import HolaTitanLM, ModelCache, RecurrentLayerCache

MODES = ("buffers", "graph", "compile")
DECODE_MODES = ("eager", *MODES)


def resolve_mode(mode: str, model: HolaTitanLM, device: torch.device) -> str:
    """The decoding path for ``mode`` (``"auto"`` or one of :data:`DECODE_MODES`) on ``device``: ``"auto"`` is
    ``"compile"`` for a recurrent model on CUDA (340M HOLA on an H200: 267 tokens/s at batch 1 against 83 for
    ``"graph"``, docs/LOG.md; the first decoder of a process compiles for 20-50 s) and ``"eager"`` otherwise (a
    CPU, or Transformer++, which has no fixed-size cache and decodes through the model's cache object). Raises
    ``ValueError`` naming ``decode`` for a mode that cannot run here."""
    device = torch.device(device)
    if mode == "auto":
        return "compile" if device.type == "cuda" and model.args.is_recurrent and _one_token_step(model) else "eager"
    if mode not in DECODE_MODES:
        raise ValueError(f"decode: unknown mode {mode!r}; expected auto or one of {DECODE_MODES}")
    if mode in ("graph", "compile") and device.type != "cuda":
        raise ValueError(f"decode: {mode!r} captures a CUDA graph and needs a CUDA device; use 'eager' or 'buffers'")
    if mode != "eager" and not model.args.is_recurrent:
        raise ValueError(f"decode: {mode!r} needs a fixed-size cache (HOLA, HOLA+recency, GDN); "
                         f"{model.args.flavour} decodes eagerly")
    if mode in ("graph", "compile") and not _one_token_step(model):
        raise ValueError(f"decode: {mode!r} needs the one-token step (hola_titan/kernels/hola/decode.py); the model's "
                         "'reference' backend runs the blocked continuation, which reads values back to the host "
                         "and cannot be captured; use 'eager' or 'buffers'")
    return mode


def _one_token_step(model: HolaTitanLM) -> bool:
    """Whether the token mixer takes the one-token step (every backend but ``"reference"``)."""
    first = next(iter(model.layers.values())).attn
    settings = getattr(first, "settings", None)  # recurrent mixers (Transformer++ has none)
    return settings is not None and settings.backend != "reference"


class _Layout:
    """Where each tensor of a recurrent model's cache sits in a flat list per layer, and how to rebuild a layer's
    cache from one."""

    def __init__(self, cache: ModelCache, layer_names: list[str]):
        self.layer_names = layer_names
        self.hola_meta: dict | None = None
        for name in layer_names:
            layer = cache.layers.get(name)
            if not isinstance(layer, RecurrentLayerCache) or layer.state is None:
                raise ValueError(f"cache: layer {name} holds no recurrent state; prefill the cache first")
            # Every layer has the same window, block and evict (one ModelArgs).
            self.hola_meta = layer.meta()

    def flatten(self, cache: ModelCache) -> list[list[torch.Tensor]]:
        return [flatten_layer(cache.layers[name]) for name in self.layer_names]


def flatten_layer(layer: RecurrentLayerCache) -> list[torch.Tensor]:
    return layer.flatten()


def unflatten_layer(tensors: list[torch.Tensor], hola_meta: dict | None) -> RecurrentLayerCache:
    return RecurrentLayerCache.unflatten(tensors, hola_meta)


def _block_step(block, h: torch.Tensor, tensors: list[torch.Tensor], hola_meta: dict | None):
    """One block's step: ``(h [B, 1, dim], the layer's cache tensors) -> (h, new cache tensors)``, a pure function
    of its inputs (the cache object it builds is local), so that it can be compiled and captured."""
    layer = unflatten_layer(tensors, hola_meta)
    h = block(h, context=NO_CONTEXT, positions=None, cache=layer)
    return h, flatten_layer(layer)


def _step_function(model: HolaTitanLM, layout: _Layout, *, compiled: bool):
    """``step(tokens [B, 1], per-layer cache tensors) -> (logits [B, V] float32, new per-layer cache tensors)``:
    ``HolaTitanLM.hidden_states`` through a cache for a recurrent model (embedding, blocks, final norm), then the
    head on the last position. With ``compiled``, each block's step is compiled once for all blocks (they share
    one structure, so Inductor compiles one graph, not one per layer)."""
    # dynamic=None (torch's default): the first batch size compiles static shapes, a second one recompiles with a
    # symbolic batch that later ones reuse (each decoder still captures its own graph).
    block_step = _block_step
    if compiled:
        block_step = torch.compile(_block_step, options={"emulate_precision_casts": True})
    blocks = [model.layers[name] for name in layout.layer_names]

    def step(tokens: torch.Tensor, tensors: list[list[torch.Tensor]]):
        h = model.tok_embeddings(tokens)
        new = []
        for block, layer_tensors in zip(blocks, tensors):
            h, stepped = block_step(block, h, layer_tensors, layout.hola_meta)
            new.append(stepped)
        logits = F.linear(model.norm(h)[:, -1], model.output_weight()).float()
        return logits, new

    return step


class StaticDecoder:
    """Decodes one token per step for every row of a prefilled cache, from buffers it owns (module docstring).

    ``cache`` is the :class:`ModelCache` a prefill filled (``model(prompt, cache=cache)`` or
    :meth:`HolaTitanLM.prefill` for left-padded prompts); it is copied, not changed. ``mode`` is ``"buffers"``,
    ``"graph"`` or ``"compile"`` (module docstring). Building runs the step once on a copy of the buffers (their
    dtypes), for a graph three more times (warm-up; for ``"compile"`` also the compilation), then captures it:
    the cache is not advanced.
    """

    def __init__(self, model: HolaTitanLM, cache: ModelCache, *, mode: str):
        if not model.args.is_recurrent:
            raise ValueError(f"decode: the static decoder needs a fixed-size cache; {model.args.flavour} has none")
        if mode not in MODES:
            raise ValueError(f"decode: unknown mode {mode!r}; expected one of {MODES}")
        self.model = model
        self.mode = mode
        self.layout = _Layout(cache, list(model.layers.keys()))
        prefilled = self.layout.flatten(cache)
        self.batch_size = prefilled[0][0].shape[0]
        self.device = prefilled[0][0].device
        if mode != "buffers":
            resolve_mode(mode, model, self.device)  # raises for a CPU or the reference backend
        self.seen = cache.seen
        self.pad_slots = cache.pad_slots
        eager_step = _step_function(model, self.layout, compiled=False)
        self._fn = _step_function(model, self.layout, compiled=True) if mode == "compile" else eager_step
        self.tokens = torch.zeros(self.batch_size, 1, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            # The step's own output dtypes (a prefill may hold a narrower one, e.g. scores): buffers take those,
            # so that writing the step's result back into them is exact.
            logits, stepped = eager_step(self.tokens, [[t.clone() for t in layer] for layer in prefilled])
            self.buffers = [[_buffer_like(p, s, name, i) for i, (p, s) in enumerate(zip(pl, sl))]
                            for name, pl, sl in zip(self.layout.layer_names, prefilled, stepped)]
            self.logits = torch.zeros_like(logits)
            self.greedy_tokens = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
            self._graph = None
            if mode != "buffers":
                self._capture()
        self.steps = 0

    @property
    def path(self) -> dict:
        """What runs: the decoding mode, the token mixer's one-token step (``hola_titan/kernels/hola/decode.py``, taken
        by every backend but ``"reference"``, which runs its blocked continuation), the batch size and the device."""
        return dict(decode=self.mode, mixer_step="hola_step" if _one_token_step(self.model) else "reference",
                    batch_size=self.batch_size, device=str(self.device),
                    dtype=str(self.logits.dtype).replace("torch.", ""))

    def _body(self) -> None:
        logits, stepped = self._fn(self.tokens, self.buffers)
        for buffers, news in zip(self.buffers, stepped):
            for buffer, new in zip(buffers, news):
                buffer.copy_(new)
        self.logits.copy_(logits)
        self.greedy_tokens.copy_(logits.argmax(dim=-1))

    def _capture(self) -> None:
        # Warm up on copies (cuBLAS handles, Triton and Inductor compilation, the allocator's pool) on a side
        # stream, as CUDA graph capture requires; the buffers themselves are not advanced.
        saved = self.buffers
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.buffers = [[t.clone() for t in layer] for layer in saved]
            for _ in range(3):
                self._body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.buffers = saved
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._body()  # recorded, not run: the buffers still hold the prefilled cache

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (``[B]`` or ``[B, 1]`` int64, one per row) and advance the cache by one token. Returns the
        next-token logits ``[B, V]`` (float32): a view of the decoder's buffer, overwritten by the next step
        (clone it to keep it). :attr:`greedy_tokens` holds their argmax."""
        tokens = tokens.reshape(-1, 1)
        if tokens.shape[0] != self.batch_size:
            raise ValueError(f"tokens: the decoder serves {self.batch_size} rows, got {tokens.shape[0]}")
        self.tokens.copy_(tokens)
        if self._graph is not None:
            self._graph.replay()
        else:
            self._body()
        self.seen += 1
        self.steps += 1
        return self.logits

    @torch.inference_mode()
    def load(self, cache: ModelCache) -> None:
        """Copy another prefilled ``cache`` (the same model, batch size and device) into the buffers, in place, so
        that one decoder and its captured graph serve one batch after another (``hola_titan.hf_model`` keeps its
        decoder across ``generate`` calls): building a decoder runs an eager step and, for a graph, warm-up and
        capture, which a short generation would pay every call. The cache's position lives in its tensors (the
        HOLA cache's ``seen``), so the graph is the same for any prompt. Raises ``ValueError`` for a cache that does
        not fit the buffers; ``cache`` itself is not changed."""
        layout = _Layout(cache, self.layout.layer_names)
        if layout.hola_meta != self.layout.hola_meta:
            raise ValueError(f"cache: HOLA settings {layout.hola_meta} differ from the decoder's "
                             f"{self.layout.hola_meta}")
        prefilled = layout.flatten(cache)
        for name, buffers, tensors in zip(self.layout.layer_names, self.buffers, prefilled, strict=True):
            if len(tensors) != len(buffers):
                raise ValueError(f"cache: layer {name} holds {len(tensors)} tensors, the decoder {len(buffers)}")
            for index, (buffer, tensor) in enumerate(zip(buffers, tensors)):
                if tensor.device != buffer.device:
                    raise ValueError(f"cache: layer {name}'s tensor {index} is on {tensor.device}, the decoder's "
                                     f"buffers on {buffer.device}")
                _check_exact(tensor, buffer, name, index)
        for buffers, tensors in zip(self.buffers, prefilled):
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
        self.seen = cache.seen
        self.pad_slots = cache.pad_slots
        self.steps = 0

    def cache(self) -> ModelCache:
        """The current cache as a :class:`ModelCache` whose tensors are the decoder's buffers (later steps change
        them in place)."""
        layers = {name: unflatten_layer(tensors, self.layout.hola_meta)
                  for name, tensors in zip(self.layout.layer_names, self.buffers)}
        return ModelCache(layers=layers, seen=self.seen, pad_slots=self.pad_slots)

    def nbytes(self) -> int:
        """Bytes of the cache buffers (constant in the context length)."""
        return sum(t.numel() * t.element_size() for layer in self.buffers for t in layer)


def _buffer_like(prefilled: torch.Tensor, stepped: torch.Tensor, layer: str, index: int) -> torch.Tensor:
    """A buffer holding ``prefilled`` in the step's dtype and shape; raises unless the conversion is exact (the same
    dtype, or a float widened)."""
    _check_exact(prefilled, stepped, layer, index)
    return prefilled.to(stepped.dtype).clone()


def _check_exact(prefilled: torch.Tensor, stepped: torch.Tensor, layer: str, index: int) -> None:
    """Raise ``ValueError`` unless ``prefilled`` goes into a tensor like ``stepped`` exactly: the same shape, and the
    same dtype or a float widened."""
    what = f"cache: layer {layer}'s tensor {index}"
    if prefilled.shape != stepped.shape:
        raise ValueError(f"{what} has shape {list(prefilled.shape)}, the decoding step writes {list(stepped.shape)}")
    widening = (prefilled.dtype.is_floating_point and stepped.dtype.is_floating_point
                and torch.promote_types(prefilled.dtype, stepped.dtype) == stepped.dtype)
    if prefilled.dtype != stepped.dtype and not widening:
        raise ValueError(f"{what} is {prefilled.dtype}, the decoding step writes {stepped.dtype}: converting would "
                         f"round it")
