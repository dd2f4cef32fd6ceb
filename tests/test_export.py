"""Export to safetensors and back: every flavour trained for two steps, checkpointed, converted with
``scripts/convert_to_safetensors.py``, then loaded natively and through ``AutoModelForCausalLM``; pinned key names;
sharding, dtype, and errors.

Tolerance: the loaded models hold the very float32 bits the trainer had and run the same code, so logits must be
equal; they are compared at 1e-6 of the logits' scale (float32 rounding), which any wrong or missing weight
exceeds by orders of magnitude.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hola_titan.hf_model  # noqa: F401  (registers the transformers classes)
from hola_titan.checkpoint import step_folder
from hola_titan.config import parse_config
from hola_titan.data import load_tokenizer
from hola_titan.export import (INDEX_FILE, SAFETENSORS_FILE, load_pretrained, read_safetensors, save_pretrained,
                               write_export_manifest)
from hola_titan.models.args import model_args, replace
from hola_titan.models.model import ModelCache, build_model
from hola_titan.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
TOL = 1e-6
PROMPT = "And God said, Let there be light: and there was light. And God saw the light, that it was good"


pytestmark = pytest.mark.usefixtures("single_thread")


def _convert(*argv: str) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import convert_to_safetensors
    finally:
        sys.path.pop(0)
    return convert_to_safetensors.main(list(argv))


def documented_keys(n_layers: int, *, flavour: str, tied: bool, use_gate: bool = False) -> set[str]:
    """The key names ``hola_titan/export.py`` documents, written out again here so that a rename fails a test."""
    keys = {"tok_embeddings.weight", "norm.weight"} | ({"output.weight"} if not tied else set())
    for i in range(n_layers):
        p = f"layers.{i}."
        keys |= {p + "attention_norm.weight", p + "ffn_norm.weight", p + "feed_forward.w1.weight",
                 p + "feed_forward.w2.weight", p + "feed_forward.w3.weight", p + "attn.q_proj.weight",
                 p + "attn.k_proj.weight", p + "attn.v_proj.weight", p + "attn.o_proj.weight"}
        if flavour != "transformer":
            keys |= {p + "attn.q_conv.weight", p + "attn.k_conv.weight", p + "attn.v_conv.weight",
                     p + "attn.a_proj.weight", p + "attn.b_proj.weight", p + "attn.A_log", p + "attn.dt_bias",
                     p + "attn.o_norm.weight"} | ({p + "attn.g_proj.weight"} if use_gate else set())
        if flavour in ("hola", "hola_recency"):
            keys |= {p + "attn.gamma_q", p + "attn.gamma_k", p + "attn.sink", p + "attn.gate"}
    return keys


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale, err = expected.abs().max().item(), (actual.double() - expected.double()).abs().max().item()
    assert err <= TOL * scale, f"{what}: max abs error {err:.3e} > {TOL} x {scale:.3e}"


def _greedy(model, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the native constant-memory cache: a prefill, then one token per call."""
    cache = ModelCache()
    logits = model(tokens, cache=cache)
    out = tokens
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, next_token], dim=1)
        logits = model(next_token, cache=cache)
    return out


@pytest.mark.parametrize("flavour", ["hola", "hola_recency", "gdn", "transformer"])
def test_trained_checkpoint_exports_and_loads_with_the_same_logits(flavour, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(parse_config([
        "--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "run"), "--model.flavour", flavour,
        "--training.steps", "2", "--training.seq_len", "128", "--training.local_batch_size", "4",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--model.attention_backend", "sdpa",
        "--checkpoint.enable", "--checkpoint.interval", "2"]))
    trainer.train()
    out = tmp_path / "export"
    assert _convert(str(step_folder(tmp_path / "run" / "checkpoint", 2)), str(out)) == 0

    args = trainer.model_args
    with safe_open(str(out / SAFETENSORS_FILE), framework="pt") as f:
        keys = set(f.keys())
    assert keys == documented_keys(args.n_layers, flavour=flavour, tied=args.tie_embeddings, use_gate=args.use_gate)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hola_titan" and config["flavour"] == flavour
    assert (config["window"], config["block"], config["vocab_size"]) == (args.window, args.block, args.vocab_size)

    tokenizer = load_tokenizer(out)
    tokens = torch.tensor([tokenizer.encode(PROMPT)[:40]] * 2)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(tokens)
        native, _ = load_pretrained(out, backend="sdpa")
        assert_logits_close(native(tokens), expected, f"{flavour}: load_pretrained")
        hf = AutoModelForCausalLM.from_pretrained(out, attention_backend="sdpa")
        assert type(hf).__name__ == "HolaTitanForCausalLM"
        assert set(hf.state_dict()) == keys
        assert_logits_close(hf(tokens).logits, expected, f"{flavour}: AutoModelForCausalLM")
        generated = hf.generate(tokens[:, :24], max_new_tokens=8, do_sample=False)
        assert torch.equal(generated, _greedy(native, tokens[:, :24], 8)), flavour


def _tiny(flavour: str, *, tied: bool = True):
    """A tiny model whose parameters are all off their init values (so a norm or gate not loaded would show)."""
    args = replace(model_args(flavour, "debug", vocab_size=97), dim=32, head_dim=16, mlp_hidden=64, block=4,
                   window=3, tie_embeddings=tied)
    model = build_model(args, device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def test_sharded_export_with_index_and_bfloat16(tmp_path):
    model = _tiny("hola", tied=False)
    tokens = torch.randint(0, 97, (2, 19))
    save_pretrained(model, None, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "sharded" / SAFETENSORS_FILE).exists()
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    loaded, tokenizer = load_pretrained(tmp_path / "sharded")
    assert tokenizer is None
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))

    save_pretrained(model, None, tmp_path / "sharded", dtype="bfloat16")  # re-export: stale shards go away
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*.safetensors*")) == [SAFETENSORS_FILE]
    assert json.loads((tmp_path / "sharded" / "config.json").read_text())["dtype"] == "bfloat16"
    state = read_safetensors(tmp_path / "sharded")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    loaded, _ = load_pretrained(tmp_path / "sharded", dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16).float()), name


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_weight_files_get_the_mode_of_the_other_export_files(tmp_path, umask):
    """safetensors writes 0600; the weights get what open() gives config.json and the rest (0666 less the umask)."""
    import os
    import stat

    old = os.umask(umask)
    try:
        save_pretrained(_tiny("gdn"), load_tokenizer("bundled"), tmp_path / "one")
        save_pretrained(_tiny("gdn"), None, tmp_path / "sharded", max_shard_bytes=20_000)
    finally:
        os.umask(old)
    for folder in ("one", "sharded"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / folder).iterdir()}
        assert any(name.endswith(".safetensors") for name in modes) and "config.json" in modes
        assert set(modes.values()) == {0o666 & ~umask}, modes


def test_load_rejects_weights_of_another_model(tmp_path):
    save_pretrained(_tiny("gdn"), None, tmp_path / "gdn")
    config = json.loads((tmp_path / "gdn" / "config.json").read_text())
    (tmp_path / "gdn" / "config.json").write_text(json.dumps(config | {"flavour": "hola"}))
    write_export_manifest(tmp_path / "gdn")  # checksums that agree: the names, not the bytes, are what is wrong
    with pytest.raises(ValueError, match=r"missing \['layers.0.attn.gamma_k'"):
        load_pretrained(tmp_path / "gdn")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "nowhere")


def test_generate_beam_search_and_continued_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny("hola")
    save_pretrained(model, None, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    prompt = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        beams = hf.generate(prompt, max_new_tokens=5, num_beams=3, do_sample=False)
        assert beams.shape == (2, 16) and torch.equal(beams[:, :11], prompt)
        with pytest.raises(ValueError, match="^attention_mask: each row must be one run"):
            hf(prompt, attention_mask=torch.tensor([[1, 0] + [1] * 9] * 2))
        with pytest.raises(ValueError, match="^attention_mask: right padding would enter the cache"):
            hf(prompt, attention_mask=torch.tensor([[1] * 10 + [0]] * 2), use_cache=True)
        # The cache returned by one call continues in the next: same logits as one call over both parts.
        first = hf(prompt[:, :7])
        second = hf(prompt[:, 7:], cache=first.cache)
        whole = model(prompt)
    assert_logits_close(torch.cat([first.logits, second.logits], 1), whole, "continued cache")


def _left_padded(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), slots), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompts), slots, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, slots - len(p):], mask[b, slots - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("flavour", ["hola", "hola_recency", "gdn", "transformer"])
def test_batched_generation_with_left_padding_equals_each_prompt_alone(flavour, tmp_path):
    """Prompts of 1 to 13 tokens, left-padded into one batch (pad id a real token id, so a leak would show): greedy
    generation of the batch equals each prompt generated alone, token for token, and the logits of every prompt's
    last position equal its own; the block (4) and window (3) make the lengths cross block and cache boundaries.
    Right padding without a cache scores the real positions as unpadded rows do."""
    from transformers import AutoModelForCausalLM

    save_pretrained(_tiny(flavour), None, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (13, 1, 6, 9, 4)]
    ids, mask = _left_padded(prompts, pad_id=5)
    with torch.no_grad():
        batch = hf.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=5)
        last = hf(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        for b, prompt in enumerate(prompts):
            alone = hf.generate(prompt[None], max_new_tokens=7, do_sample=False, pad_token_id=5)
            assert torch.equal(batch[b, ids.shape[1]:], alone[0, len(prompt):]), f"{flavour} prompt {b}"
            assert_logits_close(last[b], hf(prompt[None], use_cache=False).logits[0, -1], f"{flavour} row {b}")
        right = torch.full((2, 9), 5, dtype=torch.int64)
        right[0, :6], right[1] = prompts[2], prompts[3]
        scored = hf(right, attention_mask=(torch.arange(9)[None] < torch.tensor([[6], [9]])).long(),
                    use_cache=False).logits
        assert_logits_close(scored[0, :6], hf(prompts[2][None], use_cache=False).logits[0], "right padding")


def test_an_export_opens_with_trust_remote_code_in_a_fresh_process(tmp_path):
    """The ecosystem's standard switch: a process that never imports hola_titan.hf_model opens the folder with
    trust_remote_code=True (config.json's auto_map names the classes of modeling_hola_titan.py) and computes the
    native model's logits; without the switch transformers refuses the unknown model type."""
    import subprocess

    model = _tiny("gdn")
    save_pretrained(model, None, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hola_titan.HolaTitanForCausalLM"
    tokens = torch.randint(0, 97, (2, 9))
    torch.save({"tokens": tokens, "logits": model(tokens).detach()}, tmp_path / "expected.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
mode = sys.argv[1]
try:
    hf = AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r}, trust_remote_code=mode == "trust")
except ValueError as err:
    print("refused:", str(err).splitlines()[0]); sys.exit(3)
assert "hola_titan.hf_model" in sys.modules  # imported by the folder's module, not by this script
expected = torch.load({str(tmp_path / "expected.pt")!r})
with torch.no_grad():
    print("equal", torch.equal(hf(expected["tokens"]).logits, expected["logits"]))
"""
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    trusted = subprocess.run([sys.executable, "-c", script, "trust"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert trusted.returncode == 0 and "equal True" in trusted.stdout, trusted.stderr[-3000:]
    plain = subprocess.run([sys.executable, "-c", script, "plain"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert plain.returncode == 3, (plain.stdout, plain.stderr[-2000:])


def test_an_export_s_tokenizer_loads_without_a_question_or_a_model_type_warning(tmp_path):
    """In fresh processes, each load an export's docs name asks nothing (``input`` is recorded and answers no) and
    logs no "model of type `hola_titan` to instantiate a model of type ..." warning: the tokenizer as the stock
    ``PreTrainedTokenizerFast`` (tokenizer_config.json names it and maps no tokenizer code), by ``AutoTokenizer``
    after ``import hola_titan.hf_model`` or with ``trust_remote_code=True`` (transformers 5 resolves config.json's
    model class before it reads the tokenizer's files, and the model class is this folder's code), and the model
    with ``trust_remote_code=True``, whose config class has config.json's ``model_type``."""
    import subprocess

    tokenizer = load_tokenizer("bundled")
    save_pretrained(_tiny("gdn"), tokenizer, tmp_path / "m")
    tokenizer_config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in tokenizer_config
    script = f"""
import builtins, json, logging, sys
asked = []
builtins.input = lambda *args, **kwargs: asked.append(args) or "n"
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("transformers").addHandler(handler)
folder, mode = {str(tmp_path / "m")!r}, sys.argv[1]
types = {{}}
if mode == "stock":
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
elif mode == "imported":
    import hola_titan.hf_model
    tok = AutoTokenizer.from_pretrained(folder)
else:
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    types = {{"config": config.model_type, "class": type(config).model_type, "model": model.config.model_type}}
print(json.dumps({{"asked": len(asked), "warnings": [w for w in warnings if "model of type" in w], "types": types,
                  "ids": tok("Let there be light", add_special_tokens=True)["input_ids"],
                  "special": [tok.eos_token_id, tok.pad_token_id]}}))
"""
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for mode in ("stock", "imported", "trusted"):
        result = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                                timeout=300)
        assert result.returncode == 0, (mode, result.stderr[-3000:])
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        assert seen["asked"] == 0 and seen["warnings"] == [], (mode, seen)
        assert seen["ids"] == tokenizer.encode("Let there be light"), mode
        assert seen["special"] == [tokenizer.eos_id, tokenizer.pad_id], mode
        if mode == "trusted":
            assert seen["types"] == {"config": "hola_titan", "class": "hola_titan", "model": "hola_titan"}
