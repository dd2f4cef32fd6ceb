"""The exported model's ``generate`` (hola_titan/hf_model.py) with its decoding steps on the static decoder
(hola_titan/decoding.py; mode ``buffers``, the one a CPU runs) against transformers' loop with eager steps
(``hola_decode="eager"``): the same tokens, the same padding of finished rows, the same output length and the same
global RNG state afterwards (sampling draws from it), for greedy search and sampling, left-padded prompts of unequal
lengths, ``max_new_tokens`` and ``max_length``, EOS, lm-eval's stop-sequence criteria, returned scores and caches;
and where it falls back to eager steps, what it records and logs. The CUDA graph and compiled modes compute the
same step (tests/test_decoding_gpu.py compares them on a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import AutoModelForCausalLM, AutoTokenizer

import hola_titan.hf_model  # noqa: F401  (registers the transformers classes)
from hola_titan.data import load_tokenizer
from hola_titan.export import save_pretrained
from hola_titan.models.args import model_args, replace
from hola_titan.models.model import build_model

from helpers import flat_cache

pytestmark = pytest.mark.usefixtures("single_thread")
FLAVOURS = ("hola", "hola_recency", "gdn")
PAD = 1  # the bundled tokenizer's pad id: a real token id, so a pad leaking into a row would change it
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
GREEDY = dict(do_sample=False)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """An exported folder (with the bundled tokenizer) per flavour; block 4 and window 3, so that a few tokens
    cross block and cache boundaries; every parameter off its init value."""
    tokenizer = load_tokenizer("bundled")
    root = tmp_path_factory.mktemp("hf_generate")
    for flavour in (*FLAVOURS, "transformer"):
        args = replace(model_args(flavour, "debug", vocab_size=tokenizer.vocab_size), n_layers=2, dim=32,
                       head_dim=16, mlp_hidden=64, block=4, window=3)
        torch.manual_seed(0)
        model = build_model(args, device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        save_pretrained(model.eval(), tokenizer, root / flavour)
    return root


def _open(exports, flavour: str, **kwargs):
    return AutoModelForCausalLM.from_pretrained(exports / flavour, **kwargs)


def _left_padded(lengths: tuple[int, ...], *, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    slots = max(lengths)
    ids = torch.full((len(lengths), slots), PAD, dtype=torch.int64)
    mask = torch.zeros(len(lengths), slots, dtype=torch.int64)
    for row, n in enumerate(lengths):
        ids[row, slots - n:] = torch.randint(2, 8192, (n,), generator=gen)
        mask[row, slots - n:] = 1
    return ids, mask


def _both(hf, make_kwargs, *, seed: int = 0) -> dict:
    """``{decode: (output, generate_path, global RNG state after)}`` for transformers' eager loop and the static
    decoder, each from the same seed; ``make_kwargs()`` gives each call fresh arguments (lm-eval's criteria keep
    state)."""
    out = {}
    for decode in ("eager", "buffers"):
        torch.manual_seed(seed)
        with torch.no_grad():
            result = hf.generate(hola_decode=decode, **make_kwargs())
        out[decode] = (result, hf.generate_path, torch.get_rng_state())
    return out


def _assert_same(runs: dict) -> torch.Tensor:
    (eager, eager_path, eager_rng), (static, static_path, static_rng) = runs["eager"], runs["buffers"]
    assert eager_path["decode"] == "eager" and static_path["decode"] == "buffers"
    assert static_path["mixer_step"] == "hola_step" and static_path["steps"] > 0
    assert static.shape == eager.shape and torch.equal(static, eager)
    assert torch.equal(static_rng, eager_rng)  # as many draws: a later sampled call continues alike
    return eager


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("options", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_left_padded_batch_with_eos_equals_transformers_loop(exports, flavour, options):
    """Prompts of 9, 3, 6 and 1 tokens; an EOS that one row produces mid-way: that row is padded after it while the
    others carry on, in both paths."""
    hf = _open(exports, flavour)
    ids, mask = _left_padded((9, 3, 6, 1))
    first = _both(hf, lambda: dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD,
                                   **options))
    free = _assert_same(first)[:, ids.shape[1]:]
    eos = int(free[1, 5])
    stop = int((free[1] == eos).nonzero()[0])  # its first occurrence in row 1
    runs = _both(hf, lambda: dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD,
                                  eos_token_id=eos, **options))
    out = _assert_same(runs)[:, ids.shape[1]:]
    assert int(out[1, stop]) == eos and bool((out[1, stop + 1:] == PAD).all())
    assert out.shape[1] == 24 and not bool((out[:, -1] == PAD).all())  # another row ran to the end


def test_max_length_and_every_row_finishing(exports):
    """``max_length`` counts the padded prompt; when every row has met an EOS the loop ends early, at the same step
    in both paths."""
    hf = _open(exports, "hola")
    ids, mask = _left_padded((7, 2, 5))
    free = _assert_same(_both(hf, lambda: dict(input_ids=ids, attention_mask=mask, max_length=ids.shape[1] + 20,
                                               pad_token_id=PAD, **GREEDY)))
    assert free.shape[1] == ids.shape[1] + 20
    eos = [int(free[0, ids.shape[1] + 3]), int(free[1, ids.shape[1] + 6]), int(free[2, ids.shape[1] + 1])]
    out = _assert_same(_both(hf, lambda: dict(input_ids=ids, attention_mask=mask, max_length=ids.shape[1] + 20,
                                              pad_token_id=PAD, eos_token_id=eos, **GREEDY)))
    assert out.shape[1] < ids.shape[1] + 20


@pytest.mark.parametrize("options", [GREEDY, dict(do_sample=True, temperature=0.7)], ids=["greedy", "sampling"])
def test_lm_eval_s_call_with_its_stop_sequences(exports, options):
    """The call lm-eval's ``HFLM._model_generate`` makes: ``max_length``, a ``StoppingCriteriaList`` of its
    multi-token stop sequences (stateful: fresh per call), ``pad_token_id`` and ``use_cache``. The stop sequences
    fire (the output ends before ``max_length``) at the same step in both paths."""
    folder = exports / "gdn"
    hf, tokenizer = _open(exports, "gdn"), AutoTokenizer.from_pretrained(folder)
    ids, mask = _left_padded((8, 4, 6))
    max_length = ids.shape[1] + 40

    def kwargs():
        return dict(input_ids=ids, attention_mask=mask, max_length=max_length, use_cache=True,
                    stopping_criteria=stop_sequences_criteria(tokenizer, ["e", "\n\n"], ids.shape[1], len(ids)),
                    pad_token_id=tokenizer.pad_token_id, **options)

    out = _assert_same(_both(hf, kwargs, seed=5))
    assert out.shape[1] < max_length
    assert all("e" in tokenizer.decode(row[ids.shape[1]:]) for row in out)


def test_returned_scores_and_cache(exports):
    """``return_dict_in_generate`` with ``output_scores`` and ``output_logits``: equal per-step scores and logits,
    and the returned cache holds the decoder's state (copied out of its buffers): it equals the eager loop's and
    continues alike."""
    hf = _open(exports, "hola_recency")
    ids, mask = _left_padded((6, 2))
    runs = {}
    for decode in ("eager", "buffers"):
        torch.manual_seed(0)
        with torch.no_grad():
            runs[decode] = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=11, pad_token_id=PAD,
                                       return_dict_in_generate=True, output_scores=True, output_logits=True,
                                       hola_decode=decode, **SAMPLING)
        assert hf.generate_path["decode"] == decode
    eager, static = runs["eager"], runs["buffers"]
    assert torch.equal(eager.sequences, static.sequences)
    for a, b in zip(eager.scores + eager.logits, static.scores + static.logits, strict=True):
        assert torch.equal(a, b)
    assert static.cache.seen == eager.cache.seen == ids.shape[1] + 10
    for a, b in zip(flat_cache(eager.cache), flat_cache(static.cache), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b) and not b.is_inference()
    nxt = eager.sequences[:, -1:]
    with torch.no_grad():
        assert torch.equal(hf(nxt, cache=eager.cache).logits, hf(nxt, cache=static.cache).logits)


def test_decoder_is_kept_across_calls_of_one_batch_shape(exports):
    hf = _open(exports, "hola", decode="buffers")  # from_pretrained's config override: lm-eval's model_args
    assert hf.config.decode == "buffers"
    ids, mask = _left_padded((5, 3))
    paths, outs = [], []
    for seed in (0, 1):
        ids_now = _left_padded((5, 3), seed=seed)[0]
        with torch.no_grad():
            outs.append(hf.generate(input_ids=ids_now, attention_mask=mask, max_new_tokens=9, pad_token_id=PAD))
        paths.append(hf.generate_path)
        with torch.no_grad():
            eager = hf.generate(input_ids=ids_now, attention_mask=mask, max_new_tokens=9, pad_token_id=PAD,
                                hola_decode="eager")
        assert torch.equal(outs[-1], eager)
    assert [p["decode"] for p in paths] == ["buffers", "buffers"]
    assert [p["reused"] for p in paths] == [False, True]
    with torch.no_grad():
        hf.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, pad_token_id=PAD)
    assert hf.generate_path["reused"] is False and hf.generate_path["batch_size"] == 1  # another batch size
    hf.release_decoder()
    with torch.no_grad():
        hf.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, pad_token_id=PAD)
    assert hf.generate_path["reused"] is False
    with torch.no_grad():  # one new token comes from the prefill: no step, no decoder
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, pad_token_id=PAD)
    assert hf.generate_path == {"decode": "buffers", "steps": 0}


def _eager_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "hola_titan.hf_model" and "transformers' loop with eager steps" in r.getMessage()]


def test_where_it_falls_back_it_says_why_once(exports, caplog):
    ids, mask = _left_padded((4, 2))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD)
    caplog.set_level(logging.INFO, logger="hola_titan.hf_model")
    transformer = _open(exports, "transformer")
    with torch.no_grad():
        for _ in range(2):
            transformer.generate(**kwargs)
    assert transformer.generate_path == {
        "decode": "eager", "reason": "the transformer flavour has no fixed-size cache (its keys and values grow every "
                                     "token)"}
    assert _eager_records(caplog) == [f"generate: transformers' loop with eager steps: "
                                      f"{transformer.generate_path['reason']}"]
    with pytest.raises(ValueError, match="decode: 'buffers' needs a fixed-size cache"):
        transformer.generate(**kwargs, hola_decode="buffers")

    caplog.clear()
    hf = _open(exports, "hola")
    with torch.no_grad():
        auto = hf.generate(**kwargs)
        assert hf.generate_path["decode"] == "eager" and "CUDA only" in hf.generate_path["reason"]
        assert torch.equal(auto, hf.generate(**kwargs, hola_decode="buffers"))
        beams = {}
        for decode in ("buffers", "eager"):  # beam search: eager steps whatever the choice
            beams[decode] = hf.generate(**kwargs, num_beams=3, do_sample=False, hola_decode=decode)
            assert hf.generate_path["decode"] == "eager"
        assert torch.equal(beams["buffers"], beams["eager"])
        hf.generate(**kwargs, use_cache=False, hola_decode="buffers")
        assert hf.generate_path["reason"].startswith("use_cache=False")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hf.generate(**kwargs, hola_decode="buffers")
        assert hf.generate_path["reason"].startswith("autocast is on")
    reasons = [m.split("eager steps: ", 1)[1] for m in _eager_records(caplog)]
    assert [r.split(" ")[0] for r in reasons] == ["decode", "beam", "use_cache=False:", "autocast"]
    with pytest.raises(ValueError, match="decode: unknown choice 'fast'"):
        hf.generate(**kwargs, hola_decode="fast")
    with pytest.raises(ValueError, match="decode: 'graph' captures a CUDA graph"):
        hf.generate(**kwargs, hola_decode="graph")
