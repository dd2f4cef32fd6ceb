"""Tests of the bundled data, the tokenizer wrapper and the packed, sharded, resumable data pipeline.

The packing checks compare against a reference built independently here: the expected stream is assembled from
the documents' token lists, and document starts come from the known document lengths (not from EOS scanning).
"""

from __future__ import annotations

import gzip
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hola_titan.config import Data
from hola_titan.data import (
    IGNORE_INDEX,
    PackedDataLoader,
    build_dataloader,
    build_validation_dataloader,
    load_tokenizer,
    pack_rows,
    resolve_source,
)
from hola_titan.data.sources import read_documents
from hola_titan.data.token_stream import StreamingTokenStream, epoch_permutation

SEQ_LEN = 16


# One pytest-xdist worker runs the module: its module-scoped fixtures are made once.
pytestmark = pytest.mark.xdist_group("test_data")


def _data(dataset: str, **fields: Any) -> Data:
    """The ``[data]`` section the loaders are built from, without a hold-out: these tests read their files whole."""
    return Data(dataset=dataset, holdout_every=0, **fields)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bundled")


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of varied length (a few words to a few hundred), distinct from each other."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "the", "and", "of", "hacker"]
    return [f"doc{i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for i in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


class Reference:
    """The expected stream of unshuffled documents (one epoch), with known document start positions."""

    def __init__(self, docs: list[str], tokenizer) -> None:
        self.doc_tokens = [tokenizer.encode(d) + [tokenizer.eos_id] for d in docs]
        self.epoch = np.concatenate([np.array(t, dtype=np.int64) for t in self.doc_tokens])
        lengths = np.array([len(t) for t in self.doc_tokens])
        self.epoch_starts = set(np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist())
        self.epoch_len = len(self.epoch)

    def token(self, position: int) -> int:
        return int(self.epoch[position % self.epoch_len])

    def is_doc_start(self, position: int) -> bool:
        return position % self.epoch_len in self.epoch_starts

    def row(self, j: int) -> list[int]:
        return [self.token(p) for p in range(j * SEQ_LEN, j * SEQ_LEN + SEQ_LEN + 1)]


def check_batch_against_reference(batch: dict[str, torch.Tensor], ref: Reference, first_row: int,
                                  varlen: bool) -> None:
    rows = len(batch["input_ids"])
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (rows, SEQ_LEN)
    expected_cu = []
    for b in range(rows):
        j = first_row + b
        row = ref.row(j)
        assert batch["input_ids"][b].tolist() == row[:-1]
        base = j * SEQ_LEN
        position = 0
        for t in range(SEQ_LEN):
            starts = t == 0 or ref.is_doc_start(base + t)
            if varlen:
                if starts:
                    expected_cu.append(b * SEQ_LEN + t)
                    position = 0
                # The target at t is ignored exactly when it is the first token of a document.
                expected_label = IGNORE_INDEX if ref.is_doc_start(base + t + 1) else row[t + 1]
                assert batch["position_ids"][b, t].item() == position
                position += 1
            else:
                expected_label = row[t + 1]
                assert batch["position_ids"][b, t].item() == t
            assert batch["labels"][b, t].item() == expected_label, (j, t)
    if varlen:
        assert batch["cu_seqlens"].dtype == torch.int32
        assert batch["cu_seqlens"].tolist() == expected_cu + [rows * SEQ_LEN]
    else:
        assert "cu_seqlens" not in batch
        assert not (batch["labels"] == IGNORE_INDEX).any()


def take(loader: PackedDataLoader, count: int) -> list[dict[str, torch.Tensor]]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


def assert_same_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def test_bundled_tokenizer_ids_and_round_trip(tokenizer):
    assert tokenizer.vocab_size == 8192
    assert (tokenizer.eos_id, tokenizer.pad_id) == (0, 1)
    for text in ["In the beginning God created the heaven and the earth.", "  spaces\n\ttabs\r\n",
                 "café — “quotes” ½ 日本語 🙂", "x" * 1000, ""]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    # Ordinary English compresses well below one token per byte with a vocabulary trained on this corpus.
    text = "And God said, Let there be light: and there was light."
    assert len(tokenizer.encode(text)) < len(text) / 3
    # Text that spells the EOS token stays text, so the only EOS ids in a stream are separators.
    ids = tokenizer.encode("a<|endoftext|>b")
    assert tokenizer.eos_id not in ids and tokenizer.decode(ids) == "a<|endoftext|>b"
    assert tokenizer.decode([tokenizer.eos_id]) == "<|endoftext|>"
    assert tokenizer.encode_batch(["one", "two words"]) == [tokenizer.encode("one"), tokenizer.encode("two words")]


def test_tokenizer_save_reload_and_transformers(tokenizer, tmp_path):
    folder = tokenizer.save(tmp_path / "tok")
    text = "The Jargon File: a hacker's lexicon, 4.4.7."
    for path in (folder, folder / "tokenizer.json"):
        again = load_tokenizer(str(path))
        assert again.encode(text) == tokenizer.encode(text)
        assert (again.eos_id, again.pad_id, again.vocab_size) == (0, 1, 8192)
        assert again.fingerprint == tokenizer.fingerprint
    transformers = pytest.importorskip("transformers")
    for hf_folder in (folder, Path(__file__).resolve().parents[1] / "hola_titan" / "assets" / "tokenizer"):
        hf = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
        assert hf(text, add_special_tokens=True)["input_ids"] == tokenizer.encode(text)
        assert (hf.eos_token_id, hf.pad_token_id) == (0, 1)


def test_foreign_tokenizer_eos_detection(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 2, 5)  # no pad token: pads with EOS
    assert tok.encode("hello world") == [3, 4]
    # An explicit tokenizer_config.json wins over the guess.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert load_tokenizer(str(tmp_path)).eos_id == 1


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no/such/tokenizer"):
        load_tokenizer("no/such/tokenizer")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(bad))


# ---------------------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------------------


def test_pack_rows_docstring_example():
    eos, a1, a2, b1, b2, c1 = 0, 11, 12, 21, 22, 31
    rows = np.array([[a1, a2, eos, b1, b2, eos, c1]])
    batch = pack_rows(rows, eos_id=eos, varlen=True)
    assert batch["input_ids"].tolist() == [[a1, a2, eos, b1, b2, eos]]
    assert batch["labels"].tolist() == [[a2, eos, -100, b2, eos, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 6]
    plain = pack_rows(rows, eos_id=eos, varlen=False)
    assert plain["labels"].tolist() == [[a2, eos, b1, b2, eos, c1]]
    assert plain["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert "cu_seqlens" not in plain


def test_pack_rows_row_starts_and_edges():
    eos = 0
    # Row 0 starts mid-document; row 1 starts with an EOS (a one-token segment whose target is ignored).
    rows = np.array([[5, 6, 7, eos, 8], [eos, 9, 9, eos, eos]])
    batch = pack_rows(rows, eos_id=eos, varlen=True)
    assert batch["labels"].tolist() == [[6, 7, eos, -100], [-100, 9, eos, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 4, 5, 8]
    with pytest.raises(ValueError, match="rows"):
        pack_rows(np.zeros(5, dtype=np.int64), eos_id=eos, varlen=True)


# ---------------------------------------------------------------------------------------------------------------
# Loader: layout, resume, sharding
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    docs = make_documents(40)
    path = write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", docs)
    return docs, str(path)


@pytest.mark.parametrize("varlen", [True, False])
def test_loader_matches_reference_across_epochs(corpus, tokenizer, varlen):
    docs, path = corpus
    ref = Reference(docs, tokenizer)
    batch_size = 3
    steps = ref.epoch_len // (batch_size * SEQ_LEN) + 3  # runs into the second epoch
    loader = build_dataloader(data=_data(path, varlen=varlen), tokenizer=tokenizer, seq_len=SEQ_LEN,
                              local_batch_size=batch_size, shuffle=False)
    ignored = 0
    for step, batch in enumerate(take(loader, steps)):
        check_batch_against_reference(batch, ref, step * batch_size, varlen)
        ignored += int((batch["labels"] == IGNORE_INDEX).sum())
    assert (ignored > 0) == varlen
    assert loader.state_dict()["global_rows_consumed"] == steps * batch_size


def test_shuffle_is_a_seeded_permutation_per_epoch(corpus, tokenizer):
    docs, path = corpus
    ref = Reference(docs, tokenizer)
    orders = [epoch_permutation(len(docs), seed=3, epoch=e) for e in range(3)]
    assert all(sorted(o.tolist()) == list(range(len(docs))) for o in orders)
    assert orders[0].tolist() != orders[1].tolist() != orders[2].tolist()
    assert epoch_permutation(len(docs), seed=3, epoch=1).tolist() == orders[1].tolist()
    assert epoch_permutation(len(docs), seed=4, epoch=1).tolist() != orders[1].tolist()

    loader = build_dataloader(data=_data(path, varlen=False), tokenizer=tokenizer, seq_len=SEQ_LEN,
                              local_batch_size=1, seed=3)
    rows = 2 * ref.epoch_len // SEQ_LEN + 1
    stream = torch.cat([b["input_ids"][0] for b in take(loader, rows)]).tolist()  # inputs tile the stream
    for epoch in range(2):
        expected = [t for i in orders[epoch] for t in ref.doc_tokens[i]]
        assert stream[epoch * ref.epoch_len:(epoch + 1) * ref.epoch_len] == expected


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_gives_the_same_next_batches(corpus, tokenizer, shuffle):
    _, path = corpus
    kwargs: dict[str, Any] = dict(data=_data(path), tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=4, seed=7,
                                  shuffle=shuffle)
    reference = take(build_dataloader(**kwargs), 30)
    first = build_dataloader(**kwargs)
    take(first, 17)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = build_dataloader(**kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 13), reference[17:])
    with pytest.raises(ValueError, match="seq_len"):
        build_dataloader(**{**kwargs, "seq_len": SEQ_LEN + 1}).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        build_dataloader(**{**kwargs, "seed": 8}).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        build_dataloader(**{**kwargs, "shuffle": not shuffle}).load_state_dict(state)


def test_dp_ranks_together_see_the_single_process_rows_and_resume_at_another_degree(corpus, tokenizer):
    _, path = corpus
    common: dict[str, Any] = dict(data=_data(path), tokenizer=tokenizer, seq_len=SEQ_LEN, seed=1)
    single = take(build_dataloader(**common, local_batch_size=4), 25)
    ranks = [build_dataloader(**common, local_batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    per_rank = [take(loader, 10) for loader in ranks]
    for step in range(10):
        for key in ("input_ids", "labels", "position_ids"):
            joined = torch.cat([per_rank[0][step][key], per_rank[1][step][key]])
            assert torch.equal(joined, single[step][key])
    assert not torch.equal(per_rank[0][0]["input_ids"], per_rank[1][0]["input_ids"])
    state = ranks[1].state_dict()
    assert state == ranks[0].state_dict() and state["global_rows_consumed"] == 40
    # W = 2 state, resumed by one process with the same global batch, then with half of it.
    one = build_dataloader(**common, local_batch_size=4)
    one.load_state_dict(state)
    assert_same_batches(take(one, 15), single[10:])
    half = build_dataloader(**common, local_batch_size=2)
    half.load_state_dict(state)
    first_half = take(half, 2)
    assert torch.equal(torch.cat([b["input_ids"] for b in first_half]), single[10]["input_ids"])


def test_validation_loader_is_fixed_and_sharded(corpus, tokenizer):
    docs, path = corpus
    ref = Reference(docs, tokenizer)
    full = build_validation_dataloader(data=_data(path), split="train", tokenizer=tokenizer, seq_len=SEQ_LEN,
                                       local_batch_size=4)
    assert len(full) == ((ref.epoch_len - 1) // SEQ_LEN) // 4
    batches = list(full)
    assert len(batches) == len(full)
    assert_same_batches(list(full), batches)  # every iteration yields the same rows
    for step, batch in enumerate(batches):
        check_batch_against_reference(batch, ref, step * 4, varlen=True)
    ranks = [build_validation_dataloader(data=_data(path), split="train", tokenizer=tokenizer, seq_len=SEQ_LEN,
                                         local_batch_size=2, dp_rank=r, dp_world_size=2, max_batches=3)
             for r in range(2)]
    assert [len(r) for r in ranks] == [3, 3]
    for step, (b0, b1) in enumerate(zip(*ranks, strict=True)):
        assert torch.equal(torch.cat([b0["input_ids"], b1["input_ids"]]), batches[step]["input_ids"])


# ---------------------------------------------------------------------------------------------------------------
# Streaming (hub) data, with a stand-in for the datasets package
# ---------------------------------------------------------------------------------------------------------------


class FakeHubSplit:
    """What ``datasets.load_dataset(..., streaming=True)`` returns, as far as the pipeline uses it."""

    def __init__(self, records: list[dict[str, Any]], column_names: list[str]) -> None:
        self.records = records
        self.column_names = column_names

    def skip(self, count: int) -> FakeHubSplit:
        return FakeHubSplit(self.records[count:], self.column_names)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)


@pytest.fixture
def fake_hub(monkeypatch, corpus):
    docs, _ = corpus
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name, config, *, split, streaming):
        calls.append((name, config, split, streaming))
        return FakeHubSplit([{"content": d} for d in docs], ["content"])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return docs, calls


def test_streamed_hub_data_matches_in_memory_and_resumes(fake_hub, corpus, tokenizer):
    docs, calls = fake_hub
    _, path = corpus
    common: dict[str, Any] = dict(tokenizer=tokenizer, seq_len=SEQ_LEN, shuffle=False)
    in_memory = take(build_dataloader(data=_data(path), local_batch_size=4, **common), 30)
    hub = _data("someone/corpus", dataset_config="en", text_field="content")
    streamed = build_dataloader(data=hub, local_batch_size=4, **common)
    assert isinstance(streamed.stream, StreamingTokenStream)
    assert_same_batches(take(streamed, 12), in_memory[:12])  # runs into the second epoch
    assert calls[0] == ("someone/corpus", "en", "train", True)
    # Resume at W = 2 from the W = 1 state: skips documents, then continues on the same global rows.
    state = streamed.state_dict()
    assert {"stream_epoch", "stream_doc", "stream_offset"} <= set(state)
    for rank in range(2):
        resumed = build_dataloader(data=hub, local_batch_size=2, dp_rank=rank, dp_world_size=2, **common)
        resumed.load_state_dict(state)
        for step, batch in enumerate(take(resumed, 6)):
            expected = in_memory[12 + step]["input_ids"][2 * rank:2 * rank + 2]
            assert torch.equal(batch["input_ids"], expected)
    with pytest.raises(ValueError, match="content"):
        next(iter(build_dataloader(data=_data("someone/corpus", text_field="body"), local_batch_size=4, **common)))
    with pytest.raises(ValueError, match="max_batches"):
        build_validation_dataloader(data=_data("someone/corpus", text_field="content"), tokenizer=tokenizer,
                                    seq_len=SEQ_LEN, local_batch_size=2)
    val = build_validation_dataloader(data=_data("someone/corpus", text_field="content"), tokenizer=tokenizer,
                                      seq_len=SEQ_LEN, local_batch_size=2, max_batches=1000)
    val_in_memory = build_validation_dataloader(data=_data(path), split="train", tokenizer=tokenizer, seq_len=SEQ_LEN,
                                                local_batch_size=2)
    # Stops at the end of the single epoch (not at max_batches), on the same rows as in-memory data.
    assert_same_batches(list(val), list(val_in_memory))
    assert_same_batches(list(val), list(val))


@pytest.mark.parametrize("streamed", [False, True])
def test_validation_reads_whole_global_batches_at_any_layout(corpus, tokenizer, request, streamed):
    """A validation batch is a global batch (ranks x local batch x accumulation rows): 4 rows read as 1 x 4, as
    1 x 2 with 2 accumulation steps, or by 2 ranks x 1 with 2, are the same rows, and data that ends inside a global
    batch ends the validation at the last whole one, in memory and streamed alike."""
    _, path = corpus
    if streamed:
        request.getfixturevalue("fake_hub")
    data = _data("someone/corpus", text_field="content") if streamed else _data(path)

    def rows(ranks: int, local: int, accumulation: int) -> torch.Tensor:
        loaders = [build_validation_dataloader(data=data, split="train", tokenizer=tokenizer, seq_len=SEQ_LEN,
                                               local_batch_size=local, dp_rank=r, dp_world_size=ranks,
                                               max_batches=1000, accumulation=accumulation) for r in range(ranks)]
        per_rank = [[b["input_ids"] for b in loader] for loader in loaders]
        return torch.cat([torch.cat(batches) for batches in zip(*per_rank, strict=True)])  # global row order

    whole = rows(1, 4, 1)
    assert len(whole) % 4 == 0 and len(whole) > 8
    assert torch.equal(rows(1, 2, 2), whole) and torch.equal(rows(2, 1, 2), whole)
    assert len(rows(1, 2, 1)) >= len(whole)  # global batches of 2 rows: at most one more row pair


# ---------------------------------------------------------------------------------------------------------------
# Local files and errors
# ---------------------------------------------------------------------------------------------------------------


def test_local_file_formats(tmp_path, tokenizer, monkeypatch):
    docs = make_documents(6, seed=1)
    write_jsonl(tmp_path / "a.jsonl", docs[:2], field="body")
    (tmp_path / "b.json").write_text(json.dumps([{"body": d} for d in docs[2:4]]))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps({"body": d}) + "\n" for d in docs[4:]))
    (tmp_path / "ignored.csv").write_text("body\nnot read\n")
    source = resolve_source(str(tmp_path), split="train", text_field="body")
    assert [p.name for p in source.files] == ["a.jsonl", "b.json", "c.jsonl.gz"]
    assert list(read_documents(source)) == docs
    glob_source = resolve_source(str(tmp_path / "*.json*"), split="train", text_field="body")
    assert list(read_documents(glob_source)) == docs[:4] + docs[4:]

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "book.txt").write_text("First paragraph\nstill first.\n\n\nSecond one.\n  \nThird.\n")
    txt = resolve_source(str(tmp_path / "text"), split="train")
    assert list(read_documents(txt)) == ["First paragraph\nstill first.", "Second one.", "Third."]
    whole = resolve_source(str(tmp_path / "text" / "book.txt"), split="train", txt_documents="file")
    assert len(list(read_documents(whole))) == 1

    # A folder with split sub-folders reads the one named by the split.
    (tmp_path / "splits" / "train").mkdir(parents=True)
    (tmp_path / "splits" / "validation").mkdir()
    write_jsonl(tmp_path / "splits" / "train" / "x.jsonl", docs[:3])
    write_jsonl(tmp_path / "splits" / "validation" / "y.jsonl", docs[3:])
    assert list(read_documents(resolve_source(str(tmp_path / "splits"), split="validation"))) == docs[3:]

    # Local data works without the datasets package.
    monkeypatch.setitem(sys.modules, "datasets", None)
    loader = build_dataloader(data=_data(str(tmp_path / "text")), tokenizer=tokenizer, seq_len=4, local_batch_size=2)
    assert next(iter(loader))["input_ids"].shape == (2, 4)


def test_parquet_files(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = make_documents(5, seed=2)
    pq.write_table(pa.table({"text": docs, "n": list(range(5))}), tmp_path / "part.parquet")
    source = resolve_source(str(tmp_path / "part.parquet"), split="train")
    assert list(read_documents(source)) == docs
    ref = Reference(docs, tokenizer)
    loader = build_dataloader(data=_data(str(tmp_path / "part.parquet")), tokenizer=tokenizer, seq_len=SEQ_LEN,
                              local_batch_size=2, shuffle=False)
    check_batch_against_reference(next(iter(loader)), ref, 0, varlen=True)
    bad = resolve_source(str(tmp_path / "part.parquet"), split="train", text_field="body")
    with pytest.raises(ValueError, match="'body'.*columns: text, n"):
        list(read_documents(bad))


def test_clear_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="missing/data.jsonl"):
        build_dataloader(data=_data(str(tmp_path / "missing" / "data.jsonl")), tokenizer=tokenizer, seq_len=8,
                         local_batch_size=1)
    with pytest.raises(FileNotFoundError, match="matches no"):
        resolve_source(str(tmp_path / "*.jsonl"), split="train")
    path = write_jsonl(tmp_path / "d.jsonl", ["hello"], field="body")
    with pytest.raises(ValueError, match=r"d.jsonl line 1: no text field 'text' \(fields: body, id\)"):
        build_dataloader(data=_data(str(path)), tokenizer=tokenizer, seq_len=8, local_batch_size=1)
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="holds int"):
        list(read_documents(resolve_source(str(tmp_path / "n.jsonl"), split="train")))
    with pytest.raises(ValueError, match="split"):
        resolve_source("bundled", split="test")
    with pytest.raises(ValueError, match="dp_rank"):
        build_dataloader(data=_data(str(path), text_field="body"), tokenizer=tokenizer, seq_len=8, local_batch_size=1,
                         dp_rank=2, dp_world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        build_validation_dataloader(data=_data(str(path), text_field="body"), split="train", tokenizer=tokenizer,
                                    seq_len=64, local_batch_size=1)


# ---------------------------------------------------------------------------------------------------------------
# The bundled corpus
# ---------------------------------------------------------------------------------------------------------------


def test_bundled_corpus_splits_and_lengths(tokenizer):
    train = list(read_documents(resolve_source("bundled", split="train")))
    validation = list(read_documents(resolve_source("bundled", split="validation")))
    assert len(train) > 4000 and 50 < len(validation) < len(train) // 20
    assert not set(train) & set(validation)
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(train)]
    assert sum(n < 256 for n in lengths) > len(lengths) // 3 and sum(n > 1024 for n in lengths) > 100
    assert 1_000_000 < sum(lengths) < 3_000_000

    loader = build_dataloader(data=_data("bundled"), tokenizer=tokenizer, seq_len=256, local_batch_size=4)
    starts = sum(len(batch["cu_seqlens"]) - 1 for batch in take(loader, 20))
    # Besides the 80 row starts, about 20 * 4 * 256 / 341 (mean document length) documents start inside rows.
    assert starts - 20 * 4 > 30
    val = build_validation_dataloader(data=_data("bundled"), tokenizer=tokenizer, seq_len=256, local_batch_size=4,
                                      max_batches=5)
    assert len(val) == 5
    assert_same_batches(list(val), list(val))


# ---------------------------------------------------------------------------------------------------------------
# The token cache on disk (data.token_cache)


def _fresh_process(monkeypatch) -> None:
    """What a new process starts with: no tokenised data held in memory."""
    from hola_titan.data import loader as loader_module
    monkeypatch.setattr(loader_module, "_TOKEN_CACHE", type(loader_module._TOKEN_CACHE)())


def test_a_second_process_reads_the_tokens_from_the_cache_and_gets_the_same_batches(tmp_path, tokenizer, monkeypatch,
                                                                                  caplog):
    path = write_jsonl(tmp_path / "docs.jsonl", make_documents(60))
    cache = tmp_path / "tokens"
    kwargs = dict(data=_data(str(path)), tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=3, seed=5)
    _fresh_process(monkeypatch)
    first = take(build_dataloader(**kwargs, token_cache=cache), 12)
    assert len(list(cache.glob("*.npz"))) == 1
    _fresh_process(monkeypatch)
    with caplog.at_level("INFO", logger="hola_titan"):
        again = take(build_dataloader(**kwargs, token_cache=cache), 12)
    assert "read from the token cache" in caplog.text
    for a, b in zip(first, again, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    _fresh_process(monkeypatch)
    plain = take(build_dataloader(**kwargs), 12)  # no cache: tokenised here, the same rows
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, plain, strict=True))


def test_changed_data_is_tokenised_again_and_a_broken_cache_file_is_named_and_replaced(tmp_path, tokenizer,
                                                                                   monkeypatch, caplog):
    path = write_jsonl(tmp_path / "docs.jsonl", make_documents(40))
    cache = tmp_path / "tokens"
    data = _data("bundled")  # the file is a separate validation dataset, read whole

    def rows() -> torch.Tensor:
        _fresh_process(monkeypatch)
        loader = build_validation_dataloader(data=data, dataset=str(path), tokenizer=tokenizer, seq_len=SEQ_LEN,
                                             local_batch_size=2, token_cache=cache)
        return torch.cat([batch["input_ids"] for batch in loader])

    before = rows()
    write_jsonl(path, make_documents(40, seed=1))  # other documents: the files' size or time differ
    changed = rows()
    assert not torch.equal(before[: len(changed)], changed[: len(before)])
    assert len(list(cache.glob("*.npz"))) == 2
    newest = max(cache.glob("*.npz"), key=lambda f: f.stat().st_mtime_ns)
    newest.write_bytes(newest.read_bytes()[:100])  # a file cut short
    with caplog.at_level("WARNING", logger="hola_titan"):
        assert torch.equal(rows(), changed)
    assert "cannot be read" in caplog.text and newest.name in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="hola_titan"):
        assert torch.equal(rows(), changed)
    assert "read from the token cache" in caplog.text  # the broken file was replaced


def test_the_trainer_s_token_cache_follows_its_two_keys():
    from hola_titan.config import parse_config
    from hola_titan.train import token_cache_folder

    assert token_cache_folder(parse_config(["--job.cache_folder", "/c"])) == Path("/c/tokens")
    assert token_cache_folder(parse_config(["--job.cache_folder", "/c", "--data.token_cache", "false"])) is None
    assert token_cache_folder(parse_config(["--job.cache_folder", ""])) is None


def test_ranks_of_a_node_hash_a_data_file_once_the_others_wait_and_read_the_cache(tmp_path):
    """While one process holds a file's hash lock (it is hashing), another waits, then reads what the first kept
    instead of hashing the file itself (shown by a kept value no hash of the file could give)."""
    import fcntl
    import threading

    from hola_titan.data import fingerprint

    data, cache = tmp_path / "data.jsonl", tmp_path / "hashes"
    data.write_text('{"text": "hello"}\n')
    key = fingerprint._stat_key(data)
    entry = fingerprint._cache_file(cache, key)
    cache.mkdir()
    holder = open(entry.with_suffix(".lock"), "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(fingerprint.file_hashes(data, hash_cache=cache)))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive(), "the second process did not wait for the one hashing"
    kept = {"sha256": "a" * 64, "head": "b" * 16, "tail": "c" * 16}
    fingerprint._write_cached(entry, key, kept)
    holder.close()  # the first process is done: its lock goes
    waiter.join(timeout=10)
    assert got == kept
    fingerprint._HASHED.pop(key, None)
