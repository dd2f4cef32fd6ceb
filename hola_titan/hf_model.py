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
the cache). Batches of prompts of different lengths are left-padded (``tokenizer.padding_side = "left"``, what
generation harnesses do): each prompt then decodes exactly as it would alone. Right padding is accepted for
scoring without a cache. Limitations: no ``inputs_embeds``, no attention weights or per-layer hidden states, no
``resize_token_embeddings``.
Tested with transformers 5.x (the cache argument is called ``cache``; ``past_key_values`` is accepted too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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
from hola_titan.export import FORMAT_VERSION, MODEL_TYPE  # noqa: E402
from hola_titan.models.args import ModelArgs, model_args  # noqa: E402
from hola_titan.models.model import AttentionLayerCache, HolaTitanLM, ModelCache, RecurrentLayerCache  # noqa: E402

_OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


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

        for layer in self.layers.values():
            if isinstance(layer, RecurrentLayerCache):
                layer.conv_q, layer.conv_k, layer.conv_v = pick(layer.conv_q), pick(layer.conv_k), pick(layer.conv_v)
                layer.state = pick(layer.state)
                if layer.hola is not None:
                    layer.hola = layer.hola.map_tensors(pick)
            elif isinstance(layer, AttentionLayerCache):
                layer.k, layer.v, layer.pad = pick(layer.k), pick(layer.v), pick(layer.pad)
        self.pad_slots = pick(self.pad_slots)


class HolaTitanForCausalLM(PreTrainedModel, GenerationMixin):
    """``HolaTitanLM`` behind the ``transformers`` causal-LM interface (module docstring)."""

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
        self.post_init()

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
