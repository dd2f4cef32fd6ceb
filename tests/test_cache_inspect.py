"""What the HOLA cache holds (hola_titan/eval/cache_inspect.py): selections, kinds, the CLI's files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hola_titan.data.synthetic import MqarSpec, mqar_row
from hola_titan.eval.cache_inspect import KINDS, cache_selections, inspect_mqar, mqar_kinds
from hola_titan.eval.cli import main as eval_main
from hola_titan.eval.runtime import EvalError
from hola_titan.models.args import model_args
from hola_titan.models.model import ModelCache, build_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _model(flavour):
    torch.manual_seed(0)
    return build_model(model_args(flavour, "debug", vocab_size=97, window=3, block=4), device="cpu").eval()


def test_selections_are_what_each_block_reads():
    model = _model("hola")
    tokens = torch.randint(0, 97, (1, 23))
    got = cache_selections(model, tokens)
    assert set(got) == set(model.layers) and got["0"].shape == (5, 2, 3)  # blocks 1..5 of 4 tokens read these
    with torch.inference_mode():
        for b in range(5):
            alone = ModelCache()  # the cache after the first b + 1 blocks in one call
            model.hidden_states(tokens[:, :4 * (b + 1)], cache=alone)
            for name in model.layers:
                want = alone.layers[name].hola.positions[0].numpy()
                assert np.array_equal(np.sort(got[name][b], -1), np.sort(want, -1))


def test_recency_holds_the_window_before_the_block():
    got = cache_selections(_model("hola_recency"), torch.randint(0, 97, (1, 20)))
    for pos in got.values():
        for b in range(pos.shape[0]):
            start = 4 * (b + 1)
            assert (np.sort(pos[b], -1) == np.arange(start - 3, start)).all()


def test_kinds_and_shares():
    spec = MqarSpec(vocab_size=97, min_pairs=5, max_pairs=5)
    row = mqar_row(spec, seq_len=40, num_pairs=5, rng=np.random.default_rng(0))
    kinds = mqar_kinds(row, 40)
    counts = {k: int((kinds == i).sum()) for i, k in enumerate(KINDS)}
    assert counts == {"key": 5, "value": 5, "query": 5, "answer": 5, "filler": 20}
    assert all(KINDS[kinds[p]] == "query" for p in row.query_positions)
    out = inspect_mqar(_model("hola"), seq_len=40, num_pairs=5)
    for layer in out["layers"].values():
        assert sum(layer["share"].values()) == pytest.approx(1.0)
        assert sum(layer["base"].values()) == pytest.approx(1.0)
        assert 0 < layer["filled"] <= 1


def test_refuses_and_writes_files(tmp_path, capsys):
    with pytest.raises(EvalError, match="gdn has no HOLA cache"):
        cache_selections(_model("gdn"), torch.zeros(1, 12, dtype=torch.int64))
    with pytest.raises(EvalError, match="too short"):
        inspect_mqar(_model("hola"), seq_len=12, num_pairs=5)
    assert eval_main(["cache", "--checkpoint", "init:hola", "--pairs", "8", "--seq-len", "128", "--out",
                      str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "cache_init-hola.json").read_text())
    assert {"kv_share@layer0", "kv_base@layer1"} <= set(result["summary"])
    assert all((tmp_path / f"cache_init-hola_layer{n}.png").stat().st_size > 0 for n in ("0", "1"))
    assert "share of selected slots" in capsys.readouterr().out


def test_cache_off_is_the_state_path_alone(tmp_path):
    from hola_titan.eval.mqar import switch_cache_off

    hola = _model("hola")
    gdn = build_model(model_args("gdn", "debug", vocab_size=97, window=3, block=4), device="cpu").eval()
    # GDN with HOLA's weights (it lacks only the cache's parameters) is HOLA with the cache switched off.
    missing = gdn.load_state_dict(hola.state_dict(), strict=False)
    assert not missing.missing_keys and all(k.endswith(("gamma_q", "gamma_k", "sink", "gate"))
                                            for k in missing.unexpected_keys)
    tokens = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        before = hola(tokens)
        assert switch_cache_off(hola) == 2 and switch_cache_off(gdn) == 0
        off = hola(tokens)
        assert not torch.allclose(before, off)
        torch.testing.assert_close(off, gdn(tokens), rtol=1e-5, atol=1e-5)
    assert eval_main(["mqar", "--checkpoint", "init:hola", "--pairs", "4", "--seq-lens", "64", "--samples", "4",
                      "--cache", "off", "--out", str(tmp_path), "--no-progress"]) == 0
    assert json.loads((tmp_path / "mqar_init-hola-cache-off.json").read_text())["settings"]["cache"] == "off"
    assert eval_main(["mqar", "--checkpoint", "init:gdn", "--pairs", "4", "--seq-lens", "64", "--samples", "4",
                      "--cache", "off", "--out", str(tmp_path), "--no-progress"]) == 2


def test_perplexity_with_the_cache_off_is_written_beside_the_cache_on_result(tmp_path):
    """``eval ppl --cache off``: the text cache-off ablation (the state path alone), in a file of its own."""
    common = ["--checkpoint", "init:hola", "--max-documents", "3", "--out", str(tmp_path), "--no-progress"]
    assert eval_main(["ppl", *common]) == 0
    assert eval_main(["ppl", *common, "--cache", "off"]) == 0
    on = json.loads((tmp_path / "ppl_init-hola.json").read_text())
    off = json.loads((tmp_path / "ppl_init-hola-cache-off.json").read_text())
    assert on["settings"]["cache"] == "on" and off["settings"]["cache"] == "off"
    assert on["summary"]["tokens"] == off["summary"]["tokens"]
    assert off["summary"]["perplexity"] != on["summary"]["perplexity"]  # the cache read took part in the first
    assert eval_main(["ppl", "--checkpoint", "init:gdn", "--max-documents", "3", "--cache", "off", "--out",
                      str(tmp_path), "--no-progress"]) == 2


def test_text_ages_of_recency_are_the_window_just_before_each_block():
    """Recency holds positions r-3..r-1 when block b reads at r = 4 (b + 1): never early, relative ages (1..3) / r."""
    from hola_titan.eval.cache_inspect import inspect_text

    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (41, 17)]
    out = inspect_text(_model("hola_recency"), docs, bins=4)
    assert out["documents"] == [41, 17] and out["mode"] == "text"
    readers = [4 * (b + 1) for n in (41, 17) for b in range(-(-n // 4) - 1) if 4 * (b + 1) < n]
    ages = [a / r for r in readers for a in (1, 2, 3) for _ in range(2)]  # two heads
    for layer in out["layers"].values():
        assert layer["early_share"] == 0.0
        assert layer["mean_relative_age"] == pytest.approx(float(np.mean(ages)))
        assert sum(b["slots"] for b in layer["bins"]) == len(ages)


def test_text_ages_count_every_held_slot_of_every_document_once():
    from hola_titan.eval.cache_inspect import EARLY, inspect_text

    model = _model("hola")
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (60, 9, 33)]
    out = inspect_text(model, docs, bins=5)
    for name, layer in out["layers"].items():
        early, ages = [], []
        for ids in docs:
            pos = cache_selections(model, torch.tensor(ids)[None])[name]
            for b in range(pos.shape[0]):
                r = 4 * (b + 1)
                for p in pos[b].ravel():
                    if p >= 0:
                        early.append(p * EARLY < r)
                        ages.append((r - p) / r)
        assert layer["early_share"] == pytest.approx(float(np.mean(early)))
        assert layer["mean_relative_age"] == pytest.approx(float(np.mean(ages)))
        assert sum(b["slots"] for b in layer["bins"]) == len(ages)
        assert all(b["from"] <= b["to"] for b in layer["bins"])
    assert np.array(out["positions"]["0"]).shape == (14, 2, 3)  # the first document: 14 reading blocks of 60 tokens
    with pytest.raises(EvalError, match="more than one block of 4 tokens"):
        inspect_text(model, [list(range(10)), [1, 2, 3]])
    with pytest.raises(EvalError, match="no document"):
        inspect_text(model, [])


def test_text_mode_of_the_cli_reads_the_longest_documents_and_writes_files(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    words = "the cache keeps what wrote most to the state regardless of distance".split()
    lines = [" ".join(words[i % len(words)] for i in range(n)) for n in (30, 400, 5, 250)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    out = tmp_path / "out"
    assert eval_main(["cache", "--checkpoint", "init:hola", "--data", str(data), "--max-documents", "2",
                      "--max-tokens", "300", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "cache_init-hola.json").read_text())
    assert result["details"]["mode"] == "text" and len(result["details"]["documents"]) == 2
    assert max(result["details"]["documents"]) == 300  # the longest, cut to --max-tokens
    assert {"early_share@layer0", "mean_relative_age@layer1"} <= set(result["summary"])
    assert (out / "cache_init-hola_layer0.png").stat().st_size > 0
    assert {"persistent@layer0", "block@layer1", "sink@layer0", "cache_to_state@layer1"} <= set(result["summary"])
    assert result["details"]["reads"]["documents"] == result["details"]["documents"]
    assert (out / "cache_init-hola_reads.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "held entries over 2 documents" in printed and "the read's softmax mass" in printed
    assert eval_main(["cache", "--checkpoint", "init:hola", "--data", str(data), "--max-documents", "0",
                      "--out", str(out), "--no-progress"]) == 2
    # The default 4 documents: the one of a few words (one block or less) holds nothing later read, and is left out.
    assert eval_main(["cache", "--checkpoint", "init:hola", "--data", str(data), "--out", str(out / "all"),
                      "--no-progress"]) == 0
    documents = json.loads((out / "all" / "cache_init-hola.json").read_text())["details"]["documents"]
    assert len(documents) == 3 and min(documents) > 32
    assert eval_main(["cache", "--checkpoint", "init:hola", "--data", str(data), "--max-tokens", "32",
                      "--out", str(out), "--no-progress"]) == 2
    assert "more than one block of 32 tokens" in capsys.readouterr().err


def test_text_ages_refuse_a_model_whose_window_is_zero():
    from hola_titan.eval.cache_inspect import inspect_text

    torch.manual_seed(0)
    model = build_model(model_args("hola", "debug", vocab_size=97, window=0, block=4), device="cpu").eval()
    with pytest.raises(EvalError, match="window is 0"):
        inspect_text(model, [list(range(20))])


def _perturbed(flavour, **kw):
    """A debug model whose cache scalars are off their init (gate, sink, gammas), so that a read split wrongly
    shows in the rebuilt output."""
    torch.manual_seed(0)
    model = build_model(model_args(flavour, "debug", vocab_size=97, block=4, **kw), device="cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("gate", "sink", "gamma_q", "gamma_k"):
                p.copy_(torch.randn_like(p) * 0.7 + (1.0 if "gamma" in name else 0.0))
    return model


@pytest.mark.parametrize("flavour, kw", [("hola", {"window": 3}), ("hola_recency", {"window": 3}),
                                         ("hola", {"window": 0}), ("hola", {"window": 5}),
                                         ("hola", {"window": 3, "state_read_scale": "one"}),
                                         ("hola", {"window": 3, "cache_mix": "per_path_norm"})])
def test_read_shares_rebuild_the_layer_output_and_sum_to_one(flavour, kw):
    """The split of the cache read (persistent entries, in-block tokens, sink) is of the read that ran: the
    output rebuilt from it equals hola_attention's, at every layer, and the three shares sum to one."""
    from hola_titan.eval.cache_inspect import _each_read, read_shares

    model = _perturbed(flavour, **kw)
    calls = []
    with torch.inference_mode(), _each_read(model, lambda name, a, o: calls.append((name, dict(a), o))):
        model.hidden_states(torch.randint(0, 97, (1, 27)))  # 6 full blocks and a ragged seventh
    assert [name for name, _, _ in calls] == list(model.layers)
    for _, a, o in calls:
        shares = read_shares(a["q"], a["k"], a["v"], a["g"], a["beta"], a["gamma_q"], a["gamma_k"], a["sink"],
                             a["gate"], window=a["window"], block=a["block"], evict=a["evict"], scale=a["scale"],
                             mix=a["mix"])
        torch.testing.assert_close(shares["o"].to(o.dtype), o[0], rtol=1e-5, atol=1e-5)
        total = shares["persistent"] + shares["block"] + shares["sink"]
        torch.testing.assert_close(total, torch.ones_like(total))
        assert (shares["persistent"][:4] == 0).all()  # the first block reads no earlier entries
        if a["window"] == 0:
            assert (shares["persistent"] == 0).all()
        else:
            assert (shares["persistent"][4:] > 0).all()
        if a["mix"] == "sum":
            assert (shares["cache_to_state"] >= 0).all()
        else:  # per path: each read is normalised before the sum, so the raw reads' ratio is not reported
            assert shares["cache_to_state"].isnan().all()


def test_read_shares_of_text_by_layer_and_position(tmp_path, capsys):
    from hola_titan.eval.cache_inspect import inspect_reads

    model = _perturbed("hola", window=3)
    docs = [list(np.random.default_rng(0).integers(0, 97, 40)), list(np.random.default_rng(1).integers(0, 97, 9))]
    out = inspect_reads(model, docs, bins=3)
    assert set(out["layers"]) == set(model.layers) and out["documents"] == [40, 9]
    for layer in out["layers"].values():
        assert layer["rebuilt_error"] < 1e-5  # the recomputed read is the one that ran
        assert layer["persistent"] + layer["block"] + layer["sink"] == pytest.approx(1.0)
        assert len(layer["per_head"]["sink"]) == 2
        assert sum(b["tokens"] for b in layer["bins"]) == 36 + 5  # every token from the second block on
    w0 = inspect_reads(_perturbed("hola", window=0), docs)
    assert all(layer["persistent"] == 0 for layer in w0["layers"].values())
    with pytest.raises(EvalError, match="more than one block"):
        inspect_reads(model, [[1, 2, 3]])
    gdn = build_model(model_args("gdn", "debug", vocab_size=97), device="cpu").eval()
    with pytest.raises(EvalError, match="no HOLA cache"):
        inspect_reads(gdn, docs)


def test_text_cache_of_window_0_has_read_shares_and_no_ages(tmp_path):
    from hola_titan.eval import report
    from hola_titan.eval.cache_inspect import inspect_text_cache

    docs = [list(np.random.default_rng(0).integers(0, 97, 30))]
    w0 = inspect_text_cache(_perturbed("hola", window=0), docs)
    assert w0["layers"] == {} and w0["positions"] == {} and w0["window"] == 0
    assert all(layer["persistent"] == 0 and layer["block"] > 0 for layer in w0["reads"]["layers"].values())
    png = report.plot_cache({"details": w0, "label": "w0"}, tmp_path / "cache_w0.png")
    assert png.name == "cache_w0_reads.png" and png.stat().st_size > 0
    held = inspect_text_cache(_perturbed("hola", window=3), docs)
    assert set(held["layers"]) == set(held["reads"]["layers"]) and held["reads"]["window"] == 3


def test_the_captured_op_is_put_back_whatever_happens():
    import hola_titan.models.model as model_module
    from hola_titan.eval.cache_inspect import _each_read

    model = _perturbed("hola", window=3)
    original = model_module.hola_attention

    def fail(name, arguments, output):
        raise RuntimeError("a record that fails")

    with pytest.raises(RuntimeError, match="a record that fails"), torch.inference_mode(), _each_read(model, fail):
        model.hidden_states(torch.randint(0, 97, (1, 12)))
    assert model_module.hola_attention is original
