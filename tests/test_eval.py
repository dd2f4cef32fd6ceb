"""Evaluation building blocks (``hola_titan.eval``, ``hola_titan.data.synthetic``): the NIAH and MQAR generators,
decoding through the cache against re-running the full forward, sampling filters, and perplexity by hand.

Tolerances. Perplexity is compared with a hand computation of the same float32 logits in another order of
calls (packed rows, cache chunks, windows), so sums of ~1e2 per-token losses agree to ~1e-6 relative; 1e-5 leaves
room and any scoring mistake (a target off by one, a missing EOS, a state carried across documents) is >1e-2.
Greedy decoding is compared token for token: the two sides differ by float rounding (~1e-7 of the logits) while
the top-2 logit gap of these models is orders of magnitude larger.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hola_titan.config import Data
from hola_titan.data import IGNORE_INDEX, build_dataloader, build_validation_dataloader, load_tokenizer
from hola_titan.data.synthetic import FILLER_ID, mqar_row, parse_mqar
from hola_titan.eval.generation import SamplingOptions, filter_logits, generate, measure_decoding_memory
from hola_titan.eval.mqar import evaluate_mqar
from hola_titan.eval.niah import SNAP_TOKENS, TASKS, build_samples, needle_text, prompt_parts, score
from hola_titan.eval.perplexity import Document, count_words, encode_documents, score_documents, summarise
from hola_titan.eval.runtime import EvalError
from hola_titan.models.args import FLAVOURS
from hola_titan.models.model import HolaTitanLM
from helpers import tiny_model


# One pytest-xdist worker runs the module: its module-scoped fixtures are made once.
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("test_eval")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bundled")




# ----------------------------------------------------------------------------------------------------------------
# NIAH generators
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_niah_samples_have_the_exact_length_and_needles_where_the_metadata_says(task, tokenizer):
    depths = [0.0, 37.5, 100.0]
    for length in (300, 1000):
        samples = build_samples(task, length=length, depths=depths, samples_per_depth=2, seed=3, tokenizer=tokenizer)
        assert len(samples) == 2 * len(depths)
        for sample in samples:
            assert len(sample.input_ids) == length
            # The text is what the ids spell: re-encoding it gives the ids back (bundled byte-level BPE).
            assert tokenizer.encode(sample.text) == sample.input_ids
            spec = TASKS[task]
            assert len(sample.needles) == spec.num_needles
            for needle in sample.needles:
                span = tokenizer.decode(sample.input_ids[needle["start"]:needle["end"]])
                assert span == " " + needle_text(spec, needle["key"], needle["value"])
            # The first needle sits within SNAP_TOKENS haystack tokens of the requested depth.
            prefix, question = prompt_parts(spec, sample.query)
            assert sample.text.startswith(prefix) and sample.text.endswith(question)
            haystack_tokens = length - len(tokenizer.encode(prefix)) - len(tokenizer.encode(question)) - sum(
                n["end"] - n["start"] for n in sample.needles)
            drift = abs(sample.needles[0]["depth"] - sample.depth) / 100 * haystack_tokens
            assert drift <= SNAP_TOKENS + 1e-6, (sample.needles[0], sample.depth)
            # Every answer is a needle value, every asked key appears in the question.
            values = {n["value"] for n in sample.needles}
            assert set(sample.answers) <= values and len(sample.answers) == (
                spec.num_keys if spec.asks_all_keys else spec.values_per_key)
            question = sample.text.rsplit("\n", 1)[1]
            assert all(key in question for key in sample.query)


def test_niah_samples_are_deterministic_for_a_seed(tokenizer):
    def build(seed):
        return build_samples("mk_niah", length=500, depths=[25.0, 75.0], samples_per_depth=2, seed=seed,
                             tokenizer=tokenizer)

    first, again, other = build(7), build(7), build(8)
    assert [s.input_ids for s in first] == [s.input_ids for s in again]
    assert [s.needles for s in first] == [s.needles for s in again]
    assert [s.answers for s in first] != [s.answers for s in other]
    # A sample does not depend on which other depths are asked for.
    alone = build_samples("mk_niah", length=500, depths=[75.0], samples_per_depth=2, seed=7, tokenizer=tokenizer)
    assert [s.input_ids for s in alone] == [s.input_ids for s in first[2:]]


def test_niah_noise_haystack_repeats_the_noise_sentences(tokenizer):
    sample = build_samples("s_niah_1", length=400, depths=[50.0], samples_per_depth=1, seed=0,
                           tokenizer=tokenizer)[0]
    assert "The grass is green. The sky is blue." in sample.text
    assert sample.answers[0].isdigit() and len(sample.answers[0]) == 7


def test_niah_too_short_length_is_an_error(tokenizer):
    with pytest.raises(EvalError, match="too short for mq_niah"):
        build_samples("mq_niah", length=100, depths=[50.0], samples_per_depth=1, seed=0, tokenizer=tokenizer)


def test_niah_scoring_is_exact_match_of_every_value():
    assert score(" 1234567.", ["1234567"]) == (True, 1.0)
    assert score(" 1234567 and 7654321", ["7654321", "1234567"]) == (True, 1.0)
    assert score(" 1234567\n7654321", ["1234567", "7654321"]) == (False, 0.5)  # only the first line counts
    assert score(" 123456", ["1234567"]) == (False, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# MQAR generator and loader
# ----------------------------------------------------------------------------------------------------------------


def test_mqar_rows_put_the_answers_where_the_metadata_says():
    spec = parse_mqar("mqar:vocab=101,pairs=3-9,power_a=0.1")
    assert (spec.vocab_size, spec.min_pairs, spec.max_pairs, spec.power_a) == (101, 3, 9, 0.1)
    for index in range(20):
        row = mqar_row(spec, seq_len=48, rng=np.random.default_rng([1, index]))
        n = row.num_pairs
        assert len(row.input_ids) == len(row.labels) == 48 and 3 <= n <= 9
        assert np.array_equal(row.input_ids[0:2 * n:2], row.keys)
        assert np.array_equal(row.input_ids[1:2 * n:2], row.values)
        assert len(set(row.keys.tolist())) == n and len(set(row.values.tolist())) == n
        assert row.keys.max() <= spec.num_keys < row.values.min() and row.values.max() < 101
        value_of = dict(zip(row.keys.tolist(), row.values.tolist()))
        assert len(row.query_positions) == n  # every pair is asked by default
        for p in row.query_positions:
            assert row.labels[p] == value_of[int(row.input_ids[p])] == row.input_ids[p + 1]
        answered = np.zeros(48, dtype=bool)
        answered[row.query_positions] = True
        assert (row.labels[~answered] == IGNORE_INDEX).all()
        rest = np.ones(48, dtype=bool)
        rest[:2 * n] = False
        rest[row.query_positions] = rest[row.query_positions + 1] = False
        assert (row.input_ids[rest] == FILLER_ID).all()


def test_mqar_loader_is_deterministic_and_independent_of_the_layout(tokenizer):
    common = dict(data=Data(dataset="mqar:vocab=512,pairs=2-8"), tokenizer=tokenizer, seq_len=64, seed=5)
    single = next(iter(build_dataloader(local_batch_size=4, **common)))
    ranks = [next(iter(build_dataloader(local_batch_size=2, dp_rank=r, dp_world_size=2, **common))) for r in (0, 1)]
    assert torch.equal(single["input_ids"], torch.cat([b["input_ids"] for b in ranks]))
    assert torch.equal(single["labels"], torch.cat([b["labels"] for b in ranks]))
    assert "cu_seqlens" not in single and single["input_ids"].shape == (4, 64)
    # Resume: a loader restored from a state continues with the next rows.
    loader = build_dataloader(local_batch_size=4, **common)
    stream = iter(loader)
    next(stream)
    state = loader.state_dict()
    expected = next(stream)
    resumed = build_dataloader(local_batch_size=4, **common)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], expected["input_ids"])
    validation = build_validation_dataloader(data=common["data"], tokenizer=tokenizer, seq_len=64,
                                             local_batch_size=4, max_batches=2)
    batches = list(validation)
    assert len(batches) == 2 and not torch.equal(batches[0]["input_ids"], single["input_ids"])
    assert torch.equal(list(validation)[1]["input_ids"], batches[1]["input_ids"])


def test_mqar_pairs_drawn_from_a_weighted_list():
    """``pairs=4:5/8:1/16:1``: each row has one of the listed counts, in proportion to the weights; the range form
    keeps its stream (the rows of earlier runs)."""
    spec = parse_mqar("mqar:vocab=301,pairs=16:1/4:5/8:1")
    assert spec.pair_mix == ((4, 5.0), (8, 1.0), (16, 1.0)) and (spec.min_pairs, spec.max_pairs) == (4, 16)
    assert spec.describe() == "mqar:vocab=301,pairs=4:5/8:1/16:1,power_a=0.01"
    assert parse_mqar(spec.describe()) == spec
    counts = {4: 0, 8: 0, 16: 0}
    for index in range(2100):
        counts[mqar_row(spec, seq_len=64, rng=np.random.default_rng([2, index])).num_pairs] += 1
    assert abs(counts[4] / 2100 - 5 / 7) < 0.03 and abs(counts[8] / 2100 - 1 / 7) < 0.03, counts
    assert parse_mqar("mqar:vocab=301,pairs=8:1").pair_mix == ((8, 1.0),)  # one weighted choice is a list too
    exact = parse_mqar("mqar:vocab=301,pairs=4:0.1234567/8:1")
    assert parse_mqar(exact.describe()) == exact  # weights written exactly
    equal = parse_mqar("mqar:vocab=301,pairs=4/8")
    assert equal.pair_mix == ((4, 1.0), (8, 1.0))
    drawn = [mqar_row(equal, seq_len=64, rng=np.random.default_rng([3, i])).num_pairs for i in range(400)]
    assert set(drawn) == {4, 8} and 160 < drawn.count(4) < 240
    ranged = parse_mqar("mqar:vocab=301,pairs=4-8")
    old = mqar_row(ranged, seq_len=64, rng=np.random.default_rng([4, 0]))
    rng = np.random.default_rng([4, 0])
    assert old.num_pairs == int(rng.integers(4, 9))  # the range's first draw, as before the lists existed


@pytest.mark.parametrize("dataset, message", [
    ("mqar:pairs=0", "pairs must be >= 1"),
    ("mqar:pairs=4:1/0:2", "each choice needs pairs >= 1"),
    ("mqar:pairs=4:1/8:0", "a finite weight > 0"),
    ("mqar:pairs=4:inf/8:1", "a finite weight > 0"),
    ("mqar:pairs=4/4", "a number of pairs of its own"),
    ("mqar:pairs=4:x/8", "is not a number"),
    ("mqar:colour=3", "unknown MQAR key 'colour'"),
    ("mqar:pairs=x", "pairs='x' is not a number"),
    ("mqar:vocab=9,pairs=8", "too few ids"),
])
def test_mqar_bad_specs_name_the_problem(dataset, message):
    with pytest.raises(ValueError, match=message):
        parse_mqar(dataset)


def test_mqar_row_too_long_for_seq_len_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="too short for 64 pairs"):
        build_dataloader(data=Data(dataset="mqar:pairs=64"), tokenizer=tokenizer, seq_len=128, local_batch_size=1)


def test_mqar_eval_scores_a_perfect_oracle():
    """A model whose logits copy the next input token answers every query; accuracy must then be 1."""
    model = tiny_model("gdn", vocab_size=61)

    class Oracle(torch.nn.Module):
        args = model.args

        def parameters(self):
            return model.parameters()

        def hidden_states(self, tokens):
            nxt = torch.roll(tokens, -1, dims=1)
            return F.one_hot(nxt, 61).float()

        def output_weight(self):
            return torch.eye(61)

    result = evaluate_mqar(Oracle(), pairs=[2, 4, 16], seq_lens=[32], num_samples=5, batch_size=2)
    assert [p["accuracy"] for p in result["points"]] == [1.0, 1.0]
    assert result["skipped"] == [{"seq_len": 32, "pairs": 16}]
    chance = evaluate_mqar(model, pairs=[4], seq_lens=[32], num_samples=4)
    assert chance["points"][0]["accuracy"] < 0.5


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


def greedy_by_full_forward(model: HolaTitanLM, prompt: torch.Tensor, steps: int) -> list[list[int]]:
    tokens = prompt
    for _ in range(steps):
        nxt = model(tokens)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_generation_with_the_cache_equals_rerunning_the_full_forward(flavour):
    model = tiny_model(flavour)
    prompt = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = greedy_by_full_forward(model, prompt, 12)
    for chunk in (4, 0):  # prefill across several blocks through the cache, and in one call
        result = generate(model, prompt, max_new_tokens=12, prefill_chunk=chunk)
        assert result.tokens == expected, f"{flavour} prefill_chunk={chunk}"
        assert result.cache.seen == 11 + 11  # the prompt and every new token but the last were fed


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = tiny_model("hola")
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    hot = SamplingOptions(temperature=1.5, top_k=20, top_p=0.9, seed=11)
    first = generate(model, prompt, max_new_tokens=10, sampling=hot).tokens
    assert generate(model, prompt, max_new_tokens=10, sampling=hot).tokens == first
    other = generate(model, prompt, max_new_tokens=10, sampling=SamplingOptions(temperature=1.5, seed=12)).tokens
    assert other != first
    greedy = generate(model, prompt, max_new_tokens=10).tokens
    assert generate(model, prompt, max_new_tokens=10, sampling=SamplingOptions(temperature=0.7, top_k=1)).tokens \
        == greedy


def test_generation_stops_at_a_stop_token():
    model = tiny_model("gdn")
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    full = generate(model, prompt, max_new_tokens=8).tokens[0]
    stopped = generate(model, prompt, max_new_tokens=8, stop_ids=(full[3],))
    assert stopped.tokens[0] == full[:full.index(full[3])] and stopped.finished == [True]


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 = 0.8 reaches top_p 0.8: the third token is dropped; top_p 0.81 keeps it.
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_decoding_memory_of_recurrent_flavours_is_constant_and_transformer_grows():
    rows = {f: measure_decoding_memory(tiny_model(f), lengths=[16, 48], new_tokens=3, prefill_chunk=8)
            for f in ("hola", "transformer")}
    hola, transformer = rows["hola"], rows["transformer"]
    a = tiny_model("hola").args
    states = a.n_layers * a.n_heads * a.head_dim ** 2 * 4  # every layer's float32 state, the least a cache holds
    assert hola[0]["cache_bytes_after_decode"] == hola[1]["cache_bytes_after_decode"] >= states
    assert transformer[1]["cache_bytes_after_decode"] > transformer[0]["cache_bytes_after_decode"]
    assert all(r["peak_bytes"] >= r["cache_bytes_after_decode"] and r["prefill_chunk"] == 8
               for r in hola + transformer)


# ----------------------------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------------------------


def hand_nll(model: HolaTitanLM, ids: list[int]) -> torch.Tensor:
    """NLL of ids[1:] given the prefix, from one plain forward pass."""
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logits = model(tokens[None, :-1])[0]
    return F.cross_entropy(logits.double(), tokens[1:], reduction="none")


@pytest.mark.parametrize("flavour", ["hola", "transformer"])
def test_perplexity_equals_exp_of_the_mean_token_loss_by_hand(flavour, tokenizer):
    model = tiny_model(flavour, vocab_size=tokenizer.vocab_size)
    texts = ["The grass is green. The sky is blue, and the sea is deep and wide.",
             "A second document: short.",
             "Third one, a little longer than the second, about hackers and kettles and the ways of the world."]
    documents = encode_documents(texts, tokenizer)
    assert [d.ids for d in documents] == [tokenizer.encode(t) + [tokenizer.eos_id] for t in texts]
    by_hand = [hand_nll(model, d.ids) for d in documents]
    total = float(sum(v.sum() for v in by_hand))
    count = sum(len(v) for v in by_hand)
    num_bytes = sum(len(t.encode()) - len(tokenizer.decode(tokenizer.encode(t)[:1]).encode()) + 1 for t in texts)
    num_words = 15 + 4 + 18  # the three texts' words, counted here by hand
    for chunk in (4096, 5):  # all documents packed in one row; long documents streamed through the cache
        result = summarise(documents, score_documents(model, documents, chunk=chunk))
        assert result["tokens"] == count and result["bytes"] == num_bytes
        assert math.isclose(result["loss"], total / count, rel_tol=1e-5)
        assert math.isclose(result["perplexity"], math.exp(total / count), rel_tol=1e-5)
        assert math.isclose(result["bits_per_byte"], total / math.log(2) / num_bytes, rel_tol=1e-5)
        assert result["words"] == num_words and result["tokens_per_word"] == count / num_words
        assert math.isclose(result["word_perplexity"], math.exp(total / num_words), rel_tol=1e-5)

    # Non-overlapping windows of 6 tokens: each window is its own forward pass.
    chunked = []
    for d in documents:
        for start in range(0, len(d.ids) - 1, 6):
            chunked.append(hand_nll(model, d.ids[start:start + 7]))
    windowed = summarise(documents, score_documents(model, documents, window=6))
    assert math.isclose(windowed["loss"], float(sum(v.sum() for v in chunked)) / count, rel_tol=1e-5)


def test_sliding_window_scores_each_target_once_with_at_least_window_minus_stride_context():
    model = tiny_model("gdn")
    ids = torch.randint(2, 97, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    doc = Document(ids=ids, target_bytes=30, words=6)
    nll = score_documents(model, [doc], window=10, stride=4)[0]
    expected = hand_nll(model, ids[:11]).numpy().tolist()  # the first window scores its 10 targets
    begin = 4
    while len(expected) < 29:
        window = hand_nll(model, ids[begin:begin + 11]).numpy()
        expected += window[len(expected) - begin:].tolist()
        begin += 4
    np.testing.assert_allclose(nll, expected, rtol=1e-5)
    with pytest.raises(EvalError, match="stride"):
        score_documents(model, [doc], window=4, stride=5)


def test_documents_that_fit_one_window_are_scored_as_whole_documents_in_few_calls(monkeypatch):
    """With ``window``, a document of at most ``window`` targets is its own only window: it goes through the packed
    path (one forward for many documents), with the same values as one window; a longer one is windowed."""
    from hola_titan.eval import perplexity

    model = tiny_model("gdn")
    gen = torch.Generator().manual_seed(4)
    docs = [Document(ids=torch.randint(2, 97, (n,), generator=gen).tolist(), target_bytes=n, words=1)
            for n in (5, 11, 9, 30)]
    calls = []
    real = perplexity._token_nll
    monkeypatch.setattr(perplexity, "_token_nll", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    nll = score_documents(model, docs, window=10)
    assert len(calls) == 1 + 3, calls  # the three short documents in one packed call, three windows of the long one
    for doc, values in zip(docs[:3], nll[:3]):
        np.testing.assert_allclose(values, hand_nll(model, doc.ids).numpy(), rtol=1e-5)
    np.testing.assert_allclose(nll[3], score_documents(model, docs[3:], window=10)[0], rtol=0)


def test_words_are_counted_as_lm_eval_s_wikitext_task_counts_them():
    """A split on runs of whitespace, edges included, as lm-eval's ``wikitext`` ``process_results`` counts: a
    document that starts with a newline has one more "word"."""
    assert count_words("one two  three\n\nfour\tfive") == 5
    assert count_words("\n = Title = \n") == 5  # '', '=', 'Title', '=', ''
    assert count_words("word") == 1 and count_words("") == 1


@pytest.mark.parametrize("flavour", ["hola", "gdn", "hola_recency"])
def test_mqar_recipes_validate_and_feed_answer_only_labels(flavour, tokenizer):
    from hola_titan.config import load_toml, validate

    config = load_toml(Path(__file__).resolve().parents[1] / "train_configs" / f"mqar_{flavour}.toml")
    validate(config, world_size=1)
    assert config.model.flavour == flavour and config.model.size == "debug"
    loader = build_dataloader(data=config.data, tokenizer=tokenizer, seq_len=config.training.seq_len,
                              local_batch_size=2, seed=config.training.seed)
    batch = next(iter(loader))
    labels, inputs = batch["labels"], batch["input_ids"]
    answered = labels != IGNORE_INDEX
    assert answered.any() and torch.equal(labels[answered], torch.roll(inputs, -1, dims=1)[answered])
    assert (answered.sum(dim=1) >= 4).all()  # at least 4 pairs, all asked
