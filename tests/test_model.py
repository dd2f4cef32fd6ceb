"""``HolaTitanLM`` (DESIGN §2 (packed documents), 4, 5, 7): parameter counts, meta-device build and
``init_weights``, module layout, packed equals separate, teacher-forced decoding, constant decoding memory,
gradients into the cache parameters, and NaN isolation between packed documents.

Tolerance: logits are compared by max-abs error over the max-abs of the expected logits (rounding error in a
chain of matmuls scales with the tensor, not with each element). 1e-5 in float32: each of the ~20 ops of the
two-layer debug model rounds at ~6e-8 relative and the two sides order their sums differently (chunked vs.
token-by-token recurrence, batched vs. single rows), so a few 1e-7 are expected; any semantic error (a state,
cache, convolution or RoPE position not reset or not carried) shows at 1e-3 or more.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hola_titan.models.args import FLAVOURS, model_args, replace
from hola_titan.models.model import GatedDeltaMixer, HolaTitanLM, ModelCache, build_model, num_params
from helpers import tiny_model as shared_tiny_model

REPO = Path(__file__).resolve().parents[1]
RECURRENT = ("hola", "hola_recency", "gdn")
VOCAB = 97
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("single_thread")


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} vs {list(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    scale, err = e.abs().max().item(), (a - e).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:g} x scale {scale:.3e}"


def tiny_model(flavour: str, *, seed: int = 0) -> HolaTitanLM:
    return shared_tiny_model(flavour, vocab_size=VOCAB, seed=seed)


def tokens(batch: int, seq_len: int, *, seed: int = 1, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# Sizes, construction, initialisation, layout
# ----------------------------------------------------------------------------------------------------------------

def _meta_model(flavour: str, size: str = "340M", vocab_size: int = 32000) -> HolaTitanLM:
    with torch.device("meta"):
        return HolaTitanLM(model_args(flavour, size, vocab_size=vocab_size))


def test_parameter_counts_340M():
    counts = {flavour: num_params(_meta_model(flavour)) for flavour in FLAVOURS}
    assert abs(counts["gdn"] - 341.6e6) <= 0.005 * 341.6e6, counts
    # 2D (gamma_q, gamma_k) + 2H (sink, gate) = 2*256 + 2*4 = 520 per layer, 24 layers
    assert counts["hola"] - counts["gdn"] == 12_480, counts
    assert counts["hola_recency"] == counts["hola"], counts
    assert abs(counts["transformer"] - 341.1e6) <= 0.005 * 341.1e6, counts


def test_gdn_has_no_cache_parameters_and_hola_has_exactly_them():
    names = {flavour: {n for n, _ in _meta_model(flavour, "debug", VOCAB).named_parameters()}
             for flavour in RECURRENT}
    extra = names["hola"] - names["gdn"]
    assert extra == {f"layers.{i}.attn.{p}" for i in range(2) for p in ("gamma_q", "gamma_k", "sink", "gate")}
    assert names["gdn"] <= names["hola"] and names["hola_recency"] == names["hola"]


@pytest.mark.parametrize("flavour,message", [("gdn", "GDN"), ("transformer", "transformer")])
def test_a_flavour_without_a_cache_refuses_to_keep_its_output(flavour, message):
    """``save_cache_output`` asks for memory kept for a HOLA cache read: a flavour without one refuses it instead
    of ignoring it (the config refuses it first; this is the model built directly)."""
    with pytest.raises(ValueError, match=f"save_cache_output: .*{message}"):
        with torch.device("meta"):
            HolaTitanLM(model_args(flavour, "debug", vocab_size=VOCAB), save_cache_output=True)
    with torch.device("meta"):  # a HOLA flavour takes it (the backend is checked at the call)
        HolaTitanLM(model_args("hola", "debug", vocab_size=VOCAB), save_cache_output=True)


@pytest.mark.parametrize("size", ["debug", "340M"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_constructor_draws_no_random_numbers(flavour, size):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    model = _meta_model(flavour, size)
    assert torch.equal(torch.get_rng_state(), before), "__init__ consumed the global RNG"
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_init_weights_after_to_empty(flavour):
    model = _meta_model(flavour, "debug", VOCAB)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), f"{name} not finite after init"
    mixers = [block.attn for block in model.layers.values()]
    for i, block in model.layers.items():
        for norm in (block.attention_norm, block.ffn_norm):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight)), f"layers.{i} norm weight"
        if flavour == "transformer":
            continue
        mixer = block.attn
        # A ~ U(1, 16): float32 log of values in [1, 16]; 1e-6 absorbs the rounding of log.
        assert mixer.A_log.min() >= -1e-6 and mixer.A_log.max() <= math.log(16) + 1e-6, mixer.A_log
        dt = F.softplus(mixer.dt_bias.double())
        # dt_bias = softplus^-1(dt) evaluated in float32: the round trip is exact to ~1e-6 relative.
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5), dt
        assert torch.equal(mixer.o_norm.weight, torch.ones_like(mixer.o_norm.weight))
        if flavour == "gdn":
            assert not hasattr(mixer, "gate") and not hasattr(mixer, "sink")
            continue
        assert torch.equal(mixer.gate, torch.full_like(mixer.gate, -4.0))
        assert torch.equal(mixer.sink, torch.zeros_like(mixer.sink))
        assert torch.equal(mixer.gamma_q, torch.ones_like(mixer.gamma_q))
        assert torch.equal(mixer.gamma_k, torch.ones_like(mixer.gamma_k))
    if flavour != "transformer":
        a_all = torch.cat([m.A_log for m in mixers])
        assert a_all.unique().numel() == a_all.numel(), "A_log is not drawn per head"
    # Same seed, same weights: the initialisation is entirely in init_weights.
    again = _meta_model(flavour, "debug", VOCAB)
    again.to_empty(device="cpu")
    torch.manual_seed(0)
    again.init_weights()
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), f"{name} differs between two inits with the same seed"


def test_decay_parameters_follow_the_mamba2_init_distribution():
    """A = exp(A_log) ~ U(1, 16) and log dt = log softplus(dt_bias) ~ U(log 1e-3, log 1e-1), over 4096 heads.

    The range checks of ``test_init_weights_after_to_empty`` cannot see a slightly wrong range on 4 heads. Here
    the sample extremes must come within 1% of the range ends (a miss has probability 0.99^4096 < 1e-17 per end)
    and the sample mean within 5 standard errors, (b - a) / sqrt(12 * 4096), of the mean of the distribution."""
    args = replace(model_args("gdn", "debug", vocab_size=VOCAB), dim=16, n_heads=4096, head_dim=2)
    with torch.device("meta"):
        mixer = GatedDeltaMixer(args)
    mixer.to_empty(device="cpu")
    torch.manual_seed(0)
    mixer.init_weights(0.02, 0.02)
    a = mixer.A_log.double().exp()
    assert a.min() >= 1 - 1e-5 and a.max() <= 16 * (1 + 1e-5), (a.min(), a.max())
    assert a.min() <= 1 + 0.15 and a.max() >= 16 - 0.15, (a.min(), a.max())
    assert abs(a.mean().item() - 8.5) <= 5 * 15 / math.sqrt(12 * 4096), a.mean()
    log_dt = F.softplus(mixer.dt_bias.double()).log()
    lo, hi = math.log(1e-3), math.log(1e-1)
    assert log_dt.min() >= lo - 1e-4 and log_dt.max() <= hi + 1e-4, (log_dt.min(), log_dt.max())
    assert log_dt.min() <= lo + 0.01 * (hi - lo) and log_dt.max() >= hi - 0.01 * (hi - lo)
    assert abs(log_dt.mean().item() - (lo + hi) / 2) <= 5 * (hi - lo) / math.sqrt(12 * 4096), log_dt.mean()


def _distributed_uses(source: str) -> list[int]:
    """Lines that import ``torch.distributed`` or reach it as an attribute (docstrings and comments may name it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("torch.distributed")
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            lines.append(node.lineno)
    return lines


def test_model_code_never_imports_torch_distributed():
    package = REPO / "hola_titan"
    files = sorted((package / "models").glob("*.py")) + sorted((package / "kernels").rglob("*.py"))
    assert sum(f.parent.name == "hola" for f in files) >= 10 and len(files) >= 25, files
    offenders = [f"{f.relative_to(REPO)}:{line}" for f in files for line in _distributed_uses(f.read_text())]
    assert not offenders, "model/kernel code imports or touches torch.distributed: " + ", ".join(offenders)
    # The check itself can fail:
    assert _distributed_uses("import torch.distributed as dist") == [1]
    assert _distributed_uses("from torch import distributed") == [1]
    assert _distributed_uses("import torch\nx = torch.distributed.get_rank()") == [2]
    assert _distributed_uses('"""Never touches torch.distributed."""') == []


# Which folders of hola_titan/kernels/ each folder's modules may import (DESIGN §8): one way, from the top down.
KERNEL_LAYERS = {"runtime": {"runtime"}, "fused": {"fused"}, "gdn": {"gdn", "runtime"},
                 "hola": {"hola", "gdn", "runtime"}}


def _kernel_imports(source: str) -> set[str]:
    """The folders of ``hola_titan.kernels`` that ``source`` imports (lazy imports inside functions included):
    ``"hola"`` for ``hola_titan.kernels.hola.stages``, ``""`` for a module at the package's top."""
    folders = set()
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["hola_titan", "kernels"] and len(parts) > 2:
                folder = parts[2] if (REPO / "hola_titan" / "kernels" / parts[2]).is_dir() else ""
                if folder or len(parts) == 3:
                    folders.add(folder)
    return folders


def test_the_kernel_folders_import_one_way():
    """``runtime`` imports nothing else of the package, ``fused`` nothing, ``gdn`` only ``runtime``, ``hola`` ``gdn``
    and ``runtime``; only ``dispatch.py``, above them, may import every folder. A circle between the folders (as
    between ``seqlens.py``, ``fla_gdn.py`` and ``hola_triton_select.py`` before the layout) fails here."""
    kernels = REPO / "hola_titan" / "kernels"
    assert set(KERNEL_LAYERS) == {p.name for p in kernels.iterdir() if p.is_dir() and p.name != "__pycache__"}
    offenders = []
    for folder, allowed in KERNEL_LAYERS.items():
        for path in sorted((kernels / folder).glob("*.py")):
            wrong = _kernel_imports(path.read_text()) - allowed
            if wrong:
                offenders.append(f"{path.relative_to(REPO)} imports {sorted(wrong)}")
    assert not offenders, "; ".join(offenders)
    # The check can fail: a lazy import up the layers, a top-level module, and the package-relative form.
    assert _kernel_imports("def f():\n    from hola_titan.kernels.hola.stages import select\n") == {"hola"}
    assert _kernel_imports("from hola_titan.kernels import dispatch") == {""}
    assert _kernel_imports("from hola_titan.kernels.hola import selection") == {"hola"}
    assert _kernel_imports("import torch") == set()


def test_every_package_folder_is_in_the_wheel():
    """pyproject lists the packages a wheel carries (``[tool.setuptools] packages``): a folder of modules left out of
    the list installs from a checkout (``pip install -e``) and goes missing from a wheel. Every folder of
    ``hola_titan`` with an ``__init__.py`` is listed, every listed one exists, and the shipped kernel tables are
    package data of the folder that holds them."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hola_titan").rglob("__init__.py")}
    assert "hola_titan.kernels.hola" in folders and len(folders) >= 9, folders
    assert set(setuptools["packages"]) == folders
    tables = sorted((REPO / "hola_titan" / "kernels" / "runtime" / "configs").glob("*.json"))
    assert tables and setuptools["package-data"]["hola_titan.kernels.runtime"] == ["configs/*.json"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_blocks_live_in_a_module_dict_keyed_by_layer_index(flavour):
    model = _meta_model(flavour, "debug", VOCAB)
    assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers.keys()) == [str(i) for i in range(model.args.n_layers)]
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.attn.q_proj.weight" in names and f"layers.{model.args.n_layers - 1}.attn.o_proj.weight" in names
    for name in names:
        assert re.match(r"^(tok_embeddings|norm|output)\.|^layers\.\d+\.", name), name
    if model.args.tie_embeddings:
        assert model.output_weight() is model.tok_embeddings.weight


# ----------------------------------------------------------------------------------------------------------------
# Packed equals separate
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu", [[0, 5, 12, 13, 20, 24], [0, 1, 12, 13, 14, 22, 24], [0, 12, 24]],
                         ids=["mixed", "len1_docs", "one_doc_per_row"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_packed_rows_equal_documents_run_separately(flavour, cu):
    model = tiny_model(flavour)
    tok = tokens(2, 12)
    with torch.no_grad():
        packed = model(tok, cu_seqlens=torch.tensor(cu, dtype=torch.int32)).reshape(1, 24, -1)
        flat = tok.reshape(1, -1)
        for n, (a, b) in enumerate(zip(cu, cu[1:])):
            alone = model(flat[:, a:b])
            assert_close_scaled(packed[:, a:b], alone, TOL, f"{flavour} document {n} [{a}, {b})")
        if cu == [0, 12, 24]:
            assert_close_scaled(packed.view(2, 12, -1), model(tok), TOL, "rows without cu_seqlens")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_batch_context_reaches_every_layer_and_equals_bare_cu_seqlens(flavour, monkeypatch):
    """The model checks bare cu_seqlens once per forward (one Documents for all its layers) and a BatchContext
    made by the caller gives the same logits; giving both, or documents of another token count, is refused."""
    from hola_titan.kernels.runtime.documents import Documents
    from hola_titan.models.context import BatchContext

    model = tiny_model(flavour)
    tok = tokens(2, 12)
    cu = torch.tensor([0, 5, 12, 13, 20, 24], dtype=torch.int32)
    made = []
    real_of = Documents.of.__func__

    def counting_of(cls, *a, **kw):
        made.append(1)
        return real_of(cls, *a, **kw)

    monkeypatch.setattr(Documents, "of", classmethod(counting_of))
    with torch.no_grad():
        bare = model(tok, cu_seqlens=cu)
        assert len(made) == 1, f"{len(made)} checks of cu_seqlens for one forward of {model.args.n_layers} layers"
        docs = Documents.from_host(cu, device="cpu", seq_len=24)
        given = model(tok, context=BatchContext(documents=docs))
    assert torch.equal(bare, given)
    with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
        model(tok, cu_seqlens=cu, context=BatchContext(documents=docs))
    with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
        model(tok[:, :6], context=BatchContext(documents=docs))
    with pytest.raises(ValueError, match=r"^documents\b"):
        BatchContext(documents=cu)


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------

SCHEDULES = {
    "token_by_token": [1] * 23,
    "prefill_then_tokens": [10] + [1] * 13,
    "chunks_then_tokens": [6, 7, 1, 5, 1, 1, 2],  # calls start inside blocks and on block boundaries
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_teacher_forced_decoding_reproduces_parallel_logits(flavour, schedule):
    model = tiny_model(flavour)
    tok = tokens(2, 23)
    with torch.no_grad():
        expected = model(tok)
        cache, outs, start = ModelCache(), [], 0
        for length in SCHEDULES[schedule]:
            outs.append(model(tok[:, start:start + length], cache=cache))
            start += length
        assert start == tok.shape[1] and cache.seen == start
    assert_close_scaled(torch.cat(outs, dim=1), expected, TOL, f"{flavour} {schedule} logits")


@pytest.mark.parametrize("flavour", RECURRENT)
def test_the_paper_s_state_read_decodes_as_it_trains(flavour):
    """``state_read_scale = "one"`` reaches every path a model takes: the parallel forward, prefill and the single
    decoding step (hola_titan/kernels/hola/decode.py) agree, and the function differs from the D^-1/2 model's."""
    model = shared_tiny_model(flavour, vocab_size=VOCAB, state_read_scale="one")
    default = shared_tiny_model(flavour, vocab_size=VOCAB)
    tok = tokens(2, 23)
    with torch.no_grad():
        expected = model(tok)
        cache, outs, start = ModelCache(), [], 0
        for length in SCHEDULES["prefill_then_tokens"]:
            outs.append(model(tok[:, start:start + length], cache=cache))
            start += length
        assert (expected - default(tok)).abs().max() > 1e-3 * expected.abs().max()
    assert_close_scaled(torch.cat(outs, dim=1), expected, TOL, f"{flavour} logits")


@pytest.mark.parametrize("mix", ["after_norm", "per_path_norm"])
@pytest.mark.parametrize("flavour", ["hola", "hola_recency"])
def test_each_mixing_point_decodes_as_it_trains_and_is_its_own_function(flavour, mix):
    """``cache_mix``: the parallel forward, prefill and the decoding step agree; each mixing point is another function
    than the default's, and every parameter (the gate through the mix) gets a finite, non-zero gradient."""
    model = shared_tiny_model(flavour, vocab_size=VOCAB, cache_mix=mix)
    default = shared_tiny_model(flavour, vocab_size=VOCAB)
    tok = tokens(2, 23)
    with torch.no_grad():
        expected = model(tok)
        cache, outs, start = ModelCache(), [], 0
        for length in SCHEDULES["chunks_then_tokens"]:
            outs.append(model(tok[:, start:start + length], cache=cache))
            start += length
        assert (expected - default(tok)).abs().max() > 1e-3 * expected.abs().max()
    assert_close_scaled(torch.cat(outs, dim=1), expected, TOL, f"{flavour} {mix} logits")
    model.train()
    F.cross_entropy(model(tok).flatten(0, 1), tok.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert all(block.attn.gate.grad.abs().min() > 0 for block in model.layers.values())


def test_per_path_norm_is_the_formula():
    """``per_path_norm`` is o_norm(o_state) + sigmoid(gate) o_norm(o_cache) with one norm weight, computed here
    from the op's parts by hand."""
    model = shared_tiny_model("hola", vocab_size=VOCAB, cache_mix="per_path_norm")
    mixer = model.layers["0"].attn
    d = mixer.head_dim
    gen = torch.Generator().manual_seed(3)
    o_state, o_cache = torch.randn(2, 5, 2, d, generator=gen), torch.randn(2, 5, 2, d, generator=gen)
    lam = torch.sigmoid(mixer.gate).view(1, 1, -1, 1)
    with torch.no_grad():
        mixer.o_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen))
        got = mixer._mix(torch.cat([o_state, lam * o_cache], dim=-1))
        want = mixer.o_norm(o_state) + lam * mixer.o_norm(o_cache)
    assert_close_scaled(got, want, 1e-6, "per_path_norm")


def test_the_gate_starts_at_its_init_and_the_paths_record_says_so():
    model = build_model(model_args("hola", "debug", vocab_size=VOCAB, gate_init=-7.5, state_read_scale="one"),
                        device="cpu")
    for block in model.layers.values():
        assert torch.equal(block.attn.gate, torch.full_like(block.attn.gate, -7.5))
    text = model.args.describe_layer()
    assert "gate init -7.5" in text and "s = 1" in text and "window 8, block 32" in text
    assert "o_norm(o_state + l o_cache)" in text
    assert "o_norm(o_state) + l o_cache" in model_args("hola", "debug", vocab_size=VOCAB,
                                                        cache_mix="after_norm").describe_layer()
    assert "D^-1/2" in model_args("gdn", "debug", vocab_size=VOCAB).describe_layer()
    with pytest.raises(ValueError, match="^model.state_read_scale"):
        model_args("hola", "debug", vocab_size=VOCAB, state_read_scale="two")
    with pytest.raises(ValueError, match="^model.cache_mix"):
        model_args("hola", "debug", vocab_size=VOCAB, cache_mix="inside")
    with pytest.raises(ValueError, match="^model.gate_init"):
        model_args("hola", "debug", vocab_size=VOCAB, gate_init=float("-inf"))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_decoding_memory_is_constant_in_context_length(flavour):
    model = tiny_model(flavour)
    tok = tokens(1, 201)
    with torch.no_grad():
        cache = ModelCache()
        model(tok[:, :40], cache=cache)
        at_40 = cache.nbytes()
        model(tok[:, 40:120], cache=cache)
        model(tok[:, 120:200], cache=cache)
        at_200 = cache.nbytes()
        model(tok[:, 200:], cache=cache)
        at_201 = cache.nbytes()
    a = model.args
    if flavour in RECURRENT:
        # At least every layer's float32 state [H, D, D]; the cache and the convolution tails come on top.
        assert at_40 >= a.n_layers * a.n_heads * a.head_dim ** 2 * 4, at_40
        assert at_200 == at_40 == at_201, (at_40, at_200, at_201)
    else:
        assert at_40 == a.n_layers * 2 * 40 * a.n_heads * a.head_dim * 4  # k and v of 40 tokens, float32
        assert at_200 == 5 * at_40 and at_201 > at_200, (at_40, at_200, at_201)


def test_hola_decoding_cache_holds_window_plus_block_entries():
    """Constant memory is (W + C) entries per head plus the state and conv tails, whatever the length."""
    model = tiny_model("hola")
    with torch.no_grad():
        cache = ModelCache()
        model(tokens(1, 50), cache=cache)
    args = model.args
    for layer in cache.layers.values():
        assert layer.hola.k.shape == (1, args.n_heads, args.window, args.head_dim)
        assert layer.hola.buf_k.shape == (1, args.n_heads, args.block, args.head_dim)
        assert layer.state.shape == (1, args.n_heads, args.head_dim, args.head_dim)
        assert int(layer.hola.seen[0]) == 50


# ----------------------------------------------------------------------------------------------------------------
# Gradients, finiteness, NaN isolation
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_parameter_gets_a_finite_gradient(flavour):
    model = tiny_model(flavour).train()
    tok = tokens(1, 24)
    cu = torch.tensor([0, 9, 10, 24])
    logits = model(tok, cu_seqlens=cu)
    assert torch.isfinite(logits).all()
    loss = F.cross_entropy(logits[0, :-1], tok[0, 1:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient reaches {name}"
        assert torch.isfinite(p.grad).all(), f"gradient of {name} not finite"
        if name.endswith(("gamma_q", "gamma_k", "sink", "gate", "A_log", "dt_bias", "conv.weight")):
            assert p.grad.abs().max() > 0, f"gradient of {name} is zero"


@pytest.mark.parametrize("flavour", RECURRENT)
def test_nan_in_one_packed_document_does_not_leak_into_other_documents(flavour):
    """A NaN embedding used only in document 1 must leave the hidden states of documents 0, 2, 3, 4 finite and
    unchanged: the state, the cache and the short convolutions reset at every document start (DESIGN §2, packed
    documents).

    (Transformer++ is left out: dense SDPA with a document mask multiplies the masked values by zero
    probabilities, so a NaN value reaches every query of its row; that is how masked attention computes.)"""
    model = tiny_model(flavour)
    cu = torch.tensor([0, 5, 12, 13, 20, 24])
    tok = tokens(2, 12, low=1)  # token 0 only where placed below
    tok[0, 7] = 0  # inside document 1 = flat positions [5, 12)
    with torch.no_grad():
        clean = model.hidden_states(tok, cu_seqlens=cu).reshape(24, -1)
        model.tok_embeddings.weight[0] = float("nan")
        poisoned = model.hidden_states(tok, cu_seqlens=cu).reshape(24, -1)
    assert torch.isnan(poisoned[7]).any(), "the poison did not reach its own token (test is vacuous)"
    others = torch.ones(24, dtype=torch.bool)
    others[5:12] = False
    leaked = (~torch.isfinite(poisoned[others])).any(-1).nonzero().flatten()
    assert leaked.numel() == 0, f"NaN leaked into flat positions {others.nonzero().flatten()[leaked].tolist()}"
    assert_close_scaled(poisoned[others], clean[others], TOL, "hidden states of the clean documents")


@pytest.mark.parametrize("flavour", ["hola", "hola_recency"])
def test_a_layer_without_a_sink_reads_as_a_sink_no_score_reaches(flavour):
    """``model.cache_sink`` false: the output is the same model's with every sink at NO_SINK (the softmax over the
    keys alone), not the output with its sinks; the sink parameters stay and get no gradient; the paths line says so."""
    from hola_titan.models.model import NO_SINK

    tokens = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    without = shared_tiny_model(flavour, vocab_size=97, cache_sink=False)
    with_sinks = shared_tiny_model(flavour, vocab_size=97)
    as_constant = shared_tiny_model(flavour, vocab_size=97)
    with torch.no_grad():
        for block in as_constant.layers.values():
            block.attn.sink.fill_(NO_SINK)
    out = without(tokens)
    assert torch.allclose(out, as_constant(tokens), atol=1e-6)
    assert not torch.allclose(out, with_sinks(tokens), atol=1e-3)
    out.square().mean().backward()
    for block in without.layers.values():
        assert block.attn.sink.grad is None and block.attn.gate.grad is not None
    assert "no sink (model.cache_sink false)" in without.args.describe_layer()
