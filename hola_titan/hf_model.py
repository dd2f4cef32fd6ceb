"""``transformers`` classes for exported hola_titan folders: ``AutoModelForCausalLM.from_pretrained`` and ``generate``.

Importing this module registers :class:`HolaTitanConfig` (``model_type = "hola_titan"``) with ``AutoConfig`` and
:class:`HolaTitanForCausalLM` with ``AutoModelForCausalLM``::

    import hola_titan.hf_model  # noqa: F401  (registers the classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder)       # a folder written by hola_titan.export
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = model.generate(tokenizer("Once", return_tensors="pt").input_ids, max_new_tokens=20, do_sample=False)

The wrapper owns the very modules of a :class:`~hola_titan.models.model.HolaTitanLM` (``hola_lm``), so its
parameter names are the native ones documented in :mod:`hola_titan.export` and its logits are the native model's.

Decoding uses the native constant-memory cache (:class:`~hola_titan.models.model.ModelCache`: recurrent state,
short-convolution tails and the bounded HOLA cache per layer; growing keys and values for Transformer++), returned
as ``output.cache`` and passed back by ``generate``; greedy, sampling and beam search work (beam search reorders
the cache). In greedy search and sampling, ``generate`` runs each one-token step of the recurrent flavours on the
static decoder of :mod:`hola_titan.decoding` where it applies (``config.decode``, default ``"auto"``: compiled in a
CUDA graph on CUDA; :meth:`HolaTitanForCausalLM.generate`), inside transformers' own loop. Batches of prompts
of different lengths are left-padded (``tokenizer.padding_side = "left"``, what generation harnesses do): each
prompt then decodes exactly as it would alone. Right padding is accepted for scoring without a cache.
Limitations: no ``inputs_embeds``, no attention weights or per-layer hidden states, no ``resize_token_embeddings``.
Tested with transformers 5.x (the cache argument is called ``cache``; ``past_key_values`` is accepted too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def _quiet_torchao():
    """transformers imports torchao when it is installed (this project's float8 dependency). On a machine whose CUDA
    or CPU does not match torchao's prebuilt extensions, torchao logs a warning per extension it cannot load, and
    torch logs deprecation notes for the enums torchao registers: none of it concerns a model that does not use
    torchao's quantized ops, so those records are dropped while transformers loads. (float8 training imports
    torchao itself, warnings included.) A filter, not a level: torch's logging setup resets levels meanwhile."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    drop = logging.Filter("no record has this name")
    for log in loggers:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(drop)


with _quiet_torchao():  # transformers resolves these names lazily: the import of torchao happens here
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

from hola_titan.data.packing import IGNORE_INDEX  # noqa: E402 - after transformers' quiet import
from hola_titan.decoding import DECODE_MODES, StaticDecoder, flatten_layer, resolve_mode  # noqa: E402
from hola_titan.export import FORMAT_VERSION, MODEL_TYPE, verify_export  # noqa: E402
from hola_titan.models.args import ModelArgs, model_args  # noqa: E402
from hola_titan.models.model import HolaTitanLM, ModelCache, RecurrentLayerCache  # noqa: E402

_OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_CACHE_KWARGS = ("cache", "past_key_values")
DECODE_CHOICES = ("auto", *DECODE_MODES)
"""Values of ``config.decode`` and of ``generate(..., hola_decode=...)`` (:meth:`HolaTitanForCausalLM.generate`)."""
logger = logging.getLogger(__name__)


def _model_args_fields():
    """A dataclass with every :class:`ModelArgs` field, defaults from the debug HOLA model's ``ModelArgs``: the HF
    config inherits its fields from it, so the two cannot drift."""
    defaults = model_args("hola", "debug", vocab_size=8192)
    return dataclasses.make_dataclass(
        "ModelArgsFields", [(f.name, f.type, dataclasses.field(default=getattr(defaults, f.name)))
                            for f in dataclasses.fields(ModelArgs)], kw_only=True)


class HolaTitanConfig(PreTrainedConfig, _model_args_fields()):
    """The ``config.json`` of an exported folder: every :class:`ModelArgs` field under its own name.

    The usual transformers names (``hidden_size``, ``num_hidden_layers``, ...) read the native fields.
    """

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "intermediate_size": "mlp_hidden", "max_position_embeddings": "max_seq_len",
                     "rms_norm_eps": "norm_eps"}

    hola_titan_format: int = FORMAT_VERSION
    attention_backend: str = "auto"
    """Token-mixer implementation (``HolaTitanLM(backend=...)``); not part of the weights."""
    decode: str = "auto"
    """How ``generate`` runs its decoding steps (one of :data:`DECODE_CHOICES`; ``generate(..., hola_decode=...)``
    overrides it per call): :meth:`HolaTitanForCausalLM.generate`. Not part of the weights; ``from_pretrained(folder,
    decode="eager")`` (lm-eval: ``--model_args ...,decode=eager``) sets it at load time."""
    tie_word_embeddings: bool = False
    """Informational only (mirrors ``tie_embeddings``): a tied head is one parameter and needs no tying here."""
    use_cache: bool = True
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    bos_token_id: int | None = None

    def model_args(self) -> ModelArgs:
        return ModelArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelArgs)})




@dataclass
class HolaTitanCache(ModelCache):
    """The native decoding cache plus the methods ``generate`` calls on a cache."""

    is_compileable = False
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        # Tells generate that it can slice a re-fed prompt by get_seq_length().
        return [False]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep batch rows ``beam_idx`` (beam search), in place."""
        def pick(t):
            return t.index_select(0, beam_idx.to(t.device)) if isinstance(t, torch.Tensor) else t

        for layer in self.layers.values():  # in place: the layer objects are the ones the caller holds
            layer.__dict__.update(layer.map_tensors(pick).__dict__)
        self.pad_slots = pick(self.pad_slots)


@dataclass
class _StaticRun:
    """One ``_sample`` call whose decoding steps run on a :class:`~hola_titan.decoding.StaticDecoder`: the mode, and
    once the first one-token step binds it, the cache object transformers' loop passes around and the decoder
    that holds its live state."""

    mode: str
    cache: ModelCache | None = None
    decoder: StaticDecoder | None = None
    reused: bool = False
    setup_seconds: float = 0.0


class HolaTitanForCausalLM(PreTrainedModel, GenerationMixin):
    """``HolaTitanLM`` behind the ``transformers`` causal-LM interface (module docstring).

    ``generate`` is transformers' own, with one change (:meth:`generate`): in greedy search and sampling each
    one-token decoding step can run on a :class:`~hola_titan.decoding.StaticDecoder` instead of an eager call
    through the cache object. :attr:`generate_path` records what the last call ran.
    """

    config_class = HolaTitanConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _tied_weights_keys = None
    supports_gradient_checkpointing = False

    def __init__(self, config: HolaTitanConfig):
        super().__init__(config)
        lm = HolaTitanLM(config.model_args(), backend=config.attention_backend)
        # Adopt the native modules (not the native model itself), so that parameter names carry no prefix and
        # checkpoints of either class load into the other unchanged.
        self.tok_embeddings = lm.tok_embeddings
        self.layers = lm.layers
        self.norm = lm.norm
        self.output = lm.output
        self.__dict__["hola_lm"] = lm  # shares every module above; not registered a second time
        self.generate_path: dict | None = None
        """What the last :meth:`generate` ran: ``decode`` (``eager``: transformers' loop with eager steps, and the
        ``reason``; or the static decoder's mode with its ``StaticDecoder.path``, ``steps``, ``reused`` and
        ``setup_seconds``)."""
        self._decode_choice: str | None = None  # set by generate for the _sample it leads to
        self._static_run: _StaticRun | None = None
        self._decoder: StaticDecoder | None = None  # kept across generate calls (StaticDecoder.load)
        self._decoder_key: tuple | None = None
        self._logged: set[str] = set()
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``, after checking a local folder's files against its ``manifest.json``
        (:func:`hola_titan.export.verify_export`): transformers reads a truncated or changed weight file without a
        word when its header still parses. ``AutoModelForCausalLM.from_pretrained`` ends here too. A hub id is
        passed on as it is.

        Raises:
            hola_titan.export.ExportCorruptError: a file differs from the manifest, naming it.
        """
        import os

        folder = pretrained_model_name_or_path
        if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder):
            verify_export(os.path.join(folder, kwargs.get("subfolder") or ""))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The forward creates its own HolaTitanCache; transformers' DynamicCache cannot hold a recurrent state.
        return False

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The native ``init_weights`` for a new model (``from_config``); nothing after a complete load.

        transformers' per-module ``_init_weights`` cannot express the native init (it skips modules without
        parameters of their own and scales output projections by depth), so the whole model is drawn at once.
        """
        params = dict(self.named_parameters())
        if any(p.is_meta for p in params.values()):
            return  # built on the meta device for loading; the weights come from the checkpoint
        loaded = {name for name, p in params.items() if getattr(p, "_is_hf_initialized", False)}
        if loaded and len(loaded) < len(params):
            raise ValueError(f"checkpoint misses weights {sorted(set(params) - loaded)[:5]}")
        if not loaded:
            self.hola_lm.init_weights()

    def _init_weights(self, module) -> None:
        # Everything happens in initialize_weights.
        return

    def generate(self, *args, hola_decode: str | None = None, **kwargs):
        """transformers' ``generate`` (every argument is its own), with the decoding steps of greedy search and
        sampling on the static decoder where it applies.

        transformers' loop runs unchanged (its logits processors and warpers, stopping criteria such as lm-eval's
        stop sequences, the padding of finished rows, ``max_length`` / ``max_new_tokens``, streamers, returned
        scores); only the model call of each one-token step changes: the decoder steps its fixed buffers
        (:mod:`hola_titan.decoding`) instead of an eager call through the cache object (7 tokens/s at 340M on an
        H200 at batch 1 against 267 compiled, docs/status.md). The prefill is the same forward either way. So the
        output is transformers' own token for token: bit for bit in the ``buffers`` and ``graph`` modes, which
        compute the eager step's arithmetic; ``compile`` differs from it only in the order of float32 sums
        (:mod:`hola_titan.decoding`), which can flip a near tie.

        Args:
            hola_decode: overrides ``config.decode`` for this call. ``"auto"`` (the default): the mode
                :func:`~hola_titan.decoding.resolve_mode` picks, ``compile`` on CUDA for the recurrent flavours
                (HOLA, HOLA+recency, GDN) and transformers' loop with eager steps elsewhere (a CPU, Transformer++,
                the ``reference`` backend). ``"eager"``: transformers' loop with eager steps, always.
                ``"buffers"``, ``"graph"``, ``"compile"``: that mode; ``ValueError`` where it cannot run (a
                graph on a CPU, Transformer++).

        Eager steps run wherever the decoder does not apply, and the first call that takes them for a given reason
        logs it (a warning naming the reason; asked-for ``eager`` logs at info): Transformer++ (no fixed-size cache),
        ``auto`` off CUDA, beam search and assisted generation (another decoding method than greedy search and
        sampling), ``use_cache=False``, ``synced_gpus``, autocast (lm-eval's ``mixed_precision_dtype``), inputs on
        another device than the model. :attr:`generate_path` records the path of every call.
        """
        choice = self.config.decode if hola_decode is None else hola_decode
        if choice not in DECODE_CHOICES:
            raise ValueError(f"decode: unknown choice {choice!r}; expected one of {DECODE_CHOICES}")
        outer = self._decode_choice
        self._decode_choice, self.generate_path = choice, None
        try:
            result = super().generate(*args, **kwargs)
        finally:
            self._decode_choice = outer
        if self.generate_path is None:  # neither _sample nor a method below ran: a Hub recipe, continuous batching
            self._record_eager("generate took another decoding method than greedy search and sampling "
                               "(custom_generate, continuous batching); it runs eager steps")
        return result

    def _sample(self, input_ids: torch.LongTensor, *args, **kwargs):
        # transformers' greedy search and sampling (generate calls it with everything after input_ids by keyword):
        # the same loop, with its one-token steps on the static decoder when _static_mode allows (forward).
        mode, reason = self._static_mode(input_ids, kwargs)
        if mode is None:
            self._record_eager(reason, asked=reason == _ASKED_EAGER)
            return super()._sample(input_ids, *args, **kwargs)
        config = kwargs.get("generation_config")
        # A cache the caller passed in, or one generate returns, outlives this call and must hold the decoder's
        # state when it ends; otherwise the cache object is dropped with the loop's locals.
        keep = (any(kwargs.get(name) is not None for name in _CACHE_KWARGS)
                or bool(getattr(config, "return_dict_in_generate", False)))
        run = _StaticRun(mode)
        self._static_run = run
        try:
            result = super()._sample(input_ids, *args, **kwargs)
        finally:
            self._static_run = None
            if run.decoder is not None and keep:
                _hand_back(run.decoder, run.cache)
        path = {"decode": mode, "steps": 0}
        if run.decoder is not None:
            path = dict(run.decoder.path, steps=run.decoder.steps, reused=run.reused,
                        setup_seconds=run.setup_seconds)
        self.generate_path = path
        message = (f"generate: transformers' loop with its decoding steps on the static decoder (decode={mode!r}, "
                   f"device {input_ids.device}; hola_titan/decoding.py)")
        if message not in self._logged:
            self._logged.add(message)
            logger.info(message)
        return result

    def _beam_search(self, *args, **kwargs):
        self._record_eager("beam search (num_beams > 1): the static decoder serves greedy search and sampling")
        return super()._beam_search(*args, **kwargs)

    def _assisted_decoding(self, *args, **kwargs):
        self._record_eager("assisted generation: the static decoder serves greedy search and sampling")
        return super()._assisted_decoding(*args, **kwargs)

    def release_decoder(self) -> None:
        """Drop the static decoder kept from the last ``generate`` (its cache buffers and, for a graph, the graph's
        memory); the next ``generate`` builds a new one."""
        self._decoder = self._decoder_key = None

    def _static_mode(self, input_ids: torch.Tensor, kwargs: dict) -> tuple[str | None, str | None]:
        """``(mode, None)`` when this ``_sample`` call's decoding steps can run on the static decoder, else
        ``(None, why not)``; ``ValueError`` for an asked-for mode that cannot run here (resolve_mode)."""
        choice = self._decode_choice or self.config.decode
        if choice == "eager":
            return None, _ASKED_EAGER
        device, lm = input_ids.device, self.hola_lm
        mode = resolve_mode(choice, lm, device)
        if mode == "eager":  # what auto picked
            if not lm.args.is_recurrent:
                return None, (f"the {lm.args.flavour} flavour has no fixed-size cache (its keys and values grow "
                              "every token)")
            if device.type != "cuda":
                return None, (f"decode 'auto' takes the static decoder on CUDA only and this generate runs on "
                              f"{device}; decode='buffers' runs it here")
            return None, ("decode 'auto': the 'reference' backend has no one-token step to capture in a graph; "
                          "decode='buffers' runs the static decoder without one")
        config = kwargs.get("generation_config")
        if kwargs.get("synced_gpus"):
            return None, "synced_gpus=True"
        if getattr(config, "is_assistant", False):
            return None, "the assistant model of assisted generation"
        if kwargs.get("use_cache") is False:
            return None, "use_cache=False: every step reruns the whole sequence without a cache"
        if device != self.device:
            return None, f"input_ids on {device}, the model on {self.device}"
        if torch.is_autocast_enabled(device.type):
            return None, ("autocast is on (e.g. lm-eval's mixed_precision_dtype): the static decoder runs the "
                          "model's own dtypes and a graph cannot capture autocast's casts")
        return mode, None

    def _record_eager(self, reason: str, *, asked: bool = False) -> None:
        self.generate_path = {"decode": "eager", "reason": reason}
        if reason not in self._logged:
            self._logged.add(reason)
            (logger.info if asked else logger.warning)("generate: transformers' loop with eager steps: %s", reason)

    def _static_step(self, run: _StaticRun, input_ids: torch.Tensor, cache: ModelCache) -> CausalLMOutputWithPast:
        """One decoding step of ``_sample`` on the static decoder, which holds ``cache``'s live state from the first
        step on (binding it: a decoder kept from an earlier call is reloaded when the cache fits it)."""
        if run.decoder is None:
            start = time.perf_counter()
            key = (run.mode, _cache_signature(cache),
                   tuple((p.data_ptr(), p.dtype, p.device) for p in self.parameters()))
            run.reused = self._decoder is not None and key == self._decoder_key
            if run.reused:
                self._decoder.load(cache)
            else:
                self._decoder = self._decoder_key = None  # free the old buffers before the new ones
                self._decoder = StaticDecoder(self.hola_lm, cache, mode=run.mode)
                self._decoder_key = key
            run.decoder, run.cache = self._decoder, cache
            run.setup_seconds = time.perf_counter() - start
        logits = run.decoder.step(input_ids[:, 0])
        cache.seen = run.decoder.seen  # get_seq_length; the cache object's tensors are stale until _hand_back
        # The decoder's float32 buffer (overwritten next step) as the logits eager forward returns: its dtype (the
        # head's, which F.linear requires of the hidden states too), so the values are the same bits.
        logits = logits[:, None].to(self.hola_lm.output_weight().dtype, copy=True)
        return CausalLMOutputWithPast(logits=logits, **{_OUTPUT_CACHE_FIELD: cache})

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.tok_embeddings

    def get_output_embeddings(self):
        return self.output

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: ModelCache | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, return_dict: bool | None = None,
                past_key_values: ModelCache | None = None, inputs_embeds: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, V]`` of ``input_ids`` ``[B, T]``, continuing from ``cache`` when given.

        Args:
            attention_mask: ``[B, T]`` (or, while decoding, ``[B, past + T]``): left padding of the prompts, or
                right padding without a cache (see :func:`_padding`).
            cache: a cache returned by an earlier call; updated in place and returned.
            labels: ``[B, T]`` targets (shifted inside, ``-100`` ignored) for a mean cross-entropy ``loss``.
            use_cache: return a cache (default ``config.use_cache``; not for a right-padded batch given without a
                cache, which is scoring: no cache is returned then).
            logits_to_keep: compute logits for only the last this many positions (0: all).
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported by HolaTitanForCausalLM; pass input_ids")
        if output_attentions or output_hidden_states:
            raise ValueError("output_attentions / output_hidden_states: not supported by HolaTitanForCausalLM")
        if return_dict is False:
            raise ValueError("return_dict=False: not supported by HolaTitanForCausalLM")
        if cache is None:
            cache = past_key_values
        if cache is not None and not isinstance(cache, ModelCache):
            raise ValueError(f"cache: expected a ModelCache returned by this model, got {type(cache).__name__}")
        continuing = cache is not None and cache.seen > 0
        explicit = use_cache is not None
        use_cache = self.config.use_cache if use_cache is None else use_cache
        padding = _padding(attention_mask, input_ids, continuing=use_cache and continuing)
        run = self._static_run
        if run is not None and cache is not None and (run.cache is cache or run.cache is None):
            one_step = input_ids.shape[1] == 1 and use_cache and continuing and labels is None
            if one_step:
                return self._static_step(run, input_ids, cache)
            if run.cache is cache:
                raise ValueError("cache: a static decoder holds this cache during generate; only one-token steps "
                                 "continue it")
        if padding == "right" and use_cache:
            if explicit or cache is not None:
                raise ValueError("attention_mask: right padding would enter the cache; pad on the left for "
                                 "generation (tokenizer.padding_side = 'left') or pass use_cache=False for scoring")
            use_cache = False  # right-padded scoring (e.g. a tokenizer's default padding): no cache to return
        if use_cache and cache is None:
            cache = HolaTitanCache()
        if padding == "left":
            # Each row's prompt runs alone and the rows' caches are stacked (HolaTitanLM.prefill): padding changes
            # no state, convolution tail, score or cache entry, so batched generation equals each prompt alone.
            lengths = attention_mask.bool().sum(dim=1).tolist()
            logits = self.hola_lm.prefill(input_ids, lengths=lengths, cache=cache if use_cache else ModelCache())
            logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        else:
            # Right padding (scoring without a cache) needs nothing: a causal model's real positions never read the
            # pad slots after them.
            hidden = self.hola_lm.hidden_states(input_ids, cache=cache if use_cache else None)
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            logits = F.linear(hidden, self.hola_lm.output_weight())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_OUTPUT_CACHE_FIELD: cache if use_cache else None})


_ASKED_EAGER = "decode='eager' (config.decode or generate(hola_decode=...)) asks for it"


def _cache_signature(cache: ModelCache) -> tuple:
    """The shape, dtype and device of every tensor of a recurrent model's cache: a decoder built from one cache
    loads another of the same signature (StaticDecoder.load)."""
    return tuple((name, *((tuple(t.shape), t.dtype, t.device) for t in flatten_layer(layer)))
                 for name, layer in cache.layers.items())


def _hand_back(decoder: StaticDecoder, cache: ModelCache) -> None:
    """Put the decoder's state into ``cache``, the object transformers' loop passed around, for a caller who keeps
    it: copies, because the decoder's buffers are inference tensors that its next call overwrites."""
    live = decoder.cache()
    cache.layers = {name: _clone_layer(layer) for name, layer in live.layers.items()}
    cache.seen, cache.pad_slots = live.seen, live.pad_slots


def _clone_layer(layer: RecurrentLayerCache) -> RecurrentLayerCache:
    return layer.map_tensors(torch.clone)


def _padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor, *, continuing: bool) -> str | None:
    """``None`` (no padding in this call), ``"left"`` or ``"right"``; ``ValueError`` for masks this model cannot
    honour exactly (holes inside a row, padding after the prompt, a row of padding only)."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    seq_len = input_ids.shape[1]
    if mask.dim() != 2 or mask.shape[0] != input_ids.shape[0] or mask.shape[1] < seq_len:
        raise ValueError(f"attention_mask: expected [B, >= T] for input_ids {list(input_ids.shape)}, got "
                         f"{list(attention_mask.shape)}")
    if continuing:
        # Decoding: generate passes the whole mask so far; only the new tokens' slots are this call's.
        if not bool(mask[:, -seq_len:].all()):
            raise ValueError("attention_mask: padding is supported in the prompt only (left padding)")
        return None
    if mask.shape[1] != seq_len:
        raise ValueError(f"attention_mask: {mask.shape[1]} slots for {seq_len} input_ids (without a cache they "
                         "must match)")
    if bool(mask.all()):
        return None
    lengths = mask.sum(dim=1, keepdim=True)
    if not bool((lengths > 0).all()):
        raise ValueError("attention_mask: a row without tokens (all padding)")
    slot = torch.arange(seq_len, device=mask.device)[None, :]
    if torch.equal(mask, slot >= seq_len - lengths):
        return "left"
    if torch.equal(mask, slot < lengths):
        return "right"
    raise ValueError("attention_mask: each row must be one run of tokens with the padding on one side")


AutoConfig.register(MODEL_TYPE, HolaTitanConfig, exist_ok=True)
AutoModelForCausalLM.register(HolaTitanConfig, HolaTitanForCausalLM, exist_ok=True)
