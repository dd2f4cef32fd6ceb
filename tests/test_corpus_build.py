"""scripts/build_corpus.py: HTML conversion, furniture lines, duplicates, the per-source cap, the splits and the
shards, on small synthetic inputs (no package is downloaded)."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from hola_titan.config import Data
from hola_titan.data import build_dataloader, build_validation_dataloader, load_tokenizer
from hola_titan.data.sources import resolve_source
from helpers import load_script

corpus = load_script("build_corpus")
Document = corpus.Document


PAGE = """<!DOCTYPE html><html><head><title>Page title</title><style>p {color: red}</style>
<script>var menu = "x";</script></head><body>
<nav><ul><li>Home</li><li>Up</li></ul></nav>
<div class="sphinxsidebar">Quick search</div>
<div role="main">
<h1>Making queries<a class="headerlink" href="#q">&para;</a></h1>
<p>Once you&rsquo;ve  created
  your <em>models</em>, Django&nbsp;gives you an API.</p>
<pre>for x in y:
    print(x)</pre>
<ul><li>first<li>second</ul>
<table><tr><th>name<td>value</table>
</div>
<footer>Last update: today</footer>
</body></html>"""


def test_html_to_text_keeps_the_main_region_as_lines():
    text = corpus.html_to_text(PAGE)
    assert text == ("Making queries\n\nOnce you\u2019ve created your models, Django gives you an API.\n\n"
                    "for x in y:\n    print(x)\n\n- first\n- second\n\nname value")


def test_html_to_text_without_a_main_region_reads_the_body_minus_furniture():
    text = corpus.html_to_text("<body><nav>Menu</nav><h2>Title</h2><p>One<br>two &amp; three</p>"
                               "<div hidden>secret</div><script>x()</script><form>Search: <input></form>"
                               "<p>Four</p></body>")
    assert text == "Title\n\nOne\ntwo & three\n\nFour"
    wrapped = corpus.html_to_text("<ul><li><section><h3>getJob</h3><p>Returns the job.</p></section></li></ul>")
    assert wrapped == "getJob\n\nReturns the job."  # no stray "-" line for an item that only wraps blocks
    assert "Menu" not in text and "secret" not in text and "Search" not in text


def test_html_skip_survives_unclosed_tags_inside_it():
    text = corpus.html_to_text("<div class='related'><p>prev<p>next<div>x</div></div><p>Body text</p>")
    assert text == "Body text"


def _doc(i: int, text: str, source: str = "s") -> Document:
    return Document(f"{source}/{i}", source, text)


def test_boilerplate_lines_recurring_on_many_pages_are_dropped():
    pages = [_doc(i, f"Previous | Next\n\nPage {i} says something.\n}}\n\nCopyright 2020") for i in range(30)]
    pages.append(_doc(99, "A page without the bar.\nCopyright 2020"))
    cleaned = corpus.drop_boilerplate_lines(pages)
    assert cleaned[0].text == "Page 0 says something.\n}"  # "}" has no letter: code, kept
    assert cleaned[-1].text == "A page without the bar."
    few = pages[:5]  # under BOILERPLATE_MIN_PAGES pages: nothing is furniture
    assert corpus.drop_boilerplate_lines(few) == few


def test_exact_duplicates_are_dropped_and_held_out_text_never_trains():
    docs = [_doc(1, "Hello  World."), _doc(2, "hello world."), _doc(3, "Other text."),
            _doc(4, "Held text.", "train-src"), _doc(5, "held   TEXT.", "book"), _doc(6, "Held text.", "book")]
    kept, dropped = corpus.deduplicate(docs, {"book"})
    assert [d.id for d in kept] == ["s/1", "s/3", "book/5"]
    assert dropped == {"s": 1, "train-src": 1, "book": 1}


@pytest.mark.parametrize("sizes", [{"a": 1000, "b": 100, "c": 50}, {"a": 500, "b": 450, "c": 40, "d": 10},
                                   {"a": 10, "b": 10, "c": 10}])
def test_source_caps_bound_every_share(sizes):
    caps = corpus.source_caps(sizes, 0.35)
    capped = {s: min(sizes[s], caps[s]) for s in sizes}
    total = sum(capped.values())
    assert all(v <= 0.35 * total + 1 for v in capped.values()), capped
    assert all(caps[s] == sizes[s] for s in sizes if sizes[s] <= 0.35 * total)  # small sources untouched


def test_apply_caps_keeps_the_smallest_id_hashes_in_source_order():
    docs = [_doc(i, "x" * 100, "big") for i in range(50)] + [_doc(i, "y" * 100, "small") for i in range(5)]
    kept, dropped = corpus.apply_caps(docs, {"big": 1000, "small": 10_000})
    big = [d for d in kept if d.source == "big"]
    assert len(big) == 10 and dropped == {"big": 40}
    expected = sorted((d for d in docs if d.source == "big"), key=lambda d: hashlib.sha256(d.id.encode()).digest())
    assert {d.id for d in big} == {d.id for d in expected[:10]}
    assert [d.id for d in big] == [d.id for d in docs if d.id in {b.id for b in big}]
    assert sum(d.source == "small" for d in kept) == 5


def test_splits_hold_out_whole_sources_and_order_train_and_validation_by_id_hash():
    docs = [_doc(i, f"text {i}") for i in range(3000)] + [_doc(i, f"book {i}", "book") for i in range(20)]
    splits = corpus.split_documents(docs, {"book"})
    assert [d.source for d in splits["heldout"]] == ["book"] * 20
    assert {d.id for d in splits["validation"]} == {d.id for d in docs[:3000] if corpus.is_validation(d.id)}
    assert 30 < len(splits["validation"]) < 100
    assert len(splits["train"]) + len(splits["validation"]) == 3000
    for split in ("train", "validation"):  # validation too: training scores only its first rows
        hashes = [hashlib.sha256(d.id.encode()).digest() for d in splits[split]]
        assert hashes == sorted(hashes), split
    with pytest.raises(ValueError, match="not unique"):
        corpus.split_documents(docs + docs[:1], set())


def test_shards_respect_the_byte_budget_and_keep_order():
    docs = [_doc(i, "w" * (50 + 37 * (i % 7))) for i in range(200)]
    shards = corpus.shard_documents(docs, 2000)
    assert [d for shard in shards for d in shard] == docs
    sizes = [sum(len(corpus._line(d)) for d in shard) for shard in shards]
    total = sum(sizes)
    assert all(size <= 2000 for size in sizes)
    biggest = max(len(corpus._line(d)) for d in docs)
    assert -(-total // 2000) <= len(shards) <= -(-total // (2000 - biggest))
    assert max(sizes) - min(sizes) <= 2 * biggest  # balanced: no tiny last shard
    big = [_doc(0, "z" * 5000), _doc(1, "small")]
    assert [len(s) for s in corpus.shard_documents(big, 1000)] == [1, 1]  # a document is never split
    assert corpus.shard_documents([], 1000) == []


def test_write_split_writes_gzip_shards_and_refuses_oversized_ones(tmp_path, monkeypatch):
    docs = [_doc(i, f"document number {i} " * 20) for i in range(40)]
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "part-00099.jsonl.gz").write_bytes(b"stale")
    written = corpus.write_split(tmp_path, "train", docs, 3000)
    files = sorted((tmp_path / "train").glob("*.jsonl.gz"))
    assert [w.path for w in written] == [f"train/{f.name}" for f in files] and len(files) > 1
    lines = [json.loads(line) for f in files for line in gzip.decompress(f.read_bytes()).decode().splitlines()]
    assert [r["id"] for r in lines] == [d.id for d in docs] and set(lines[0]) == {"id", "source", "text"}
    assert all(w.file_sha256 == hashlib.sha256((tmp_path / w.path).read_bytes()).hexdigest() for w in written)
    again = corpus.write_split(tmp_path, "train", docs, 3000)
    assert again == written  # a fixed gzip header: rebuilds are byte-identical
    monkeypatch.setattr(corpus, "MAX_FILE_MIB", 0)
    with pytest.raises(ValueError, match="lower --shard-mb"):
        corpus.write_split(tmp_path, "train", docs, 3000)


def test_sources_read_a_package_tree(tmp_path):
    base = tmp_path / "usr" / "share" / "doc" / "pkg"
    (base / "html" / "api").mkdir(parents=True)
    (base / "html" / "src").mkdir()
    for i in range(12):
        (base / "html" / "api" / f"p{i}.html").write_text(
            f"<body><div class='nav'>Index | Search</div><main><h1>Page {i}</h1><p>{f'Text of page {i}. ' * 20}</p>"
            "<p>Last updated: today</p></main></body>", encoding="utf-8")
    (base / "html" / "src" / "code.html").write_text(f"<p>{'listing ' * 50}</p>", encoding="utf-8")
    (base / "html" / "api" / "stub.html").write_text("<p>Redirecting to p0.html</p>", encoding="utf-8")
    (base / "Documentation").mkdir()
    (base / "Documentation" / "a.rst.gz").write_bytes(gzip.compress(b"Title\r\n=====\n\nBody.\n"))
    html = corpus.html_source("h", "pkg", lambda r: corpus._doc(r, "pkg") / "html", exclude=r"^src/")
    docs = html.read(tmp_path)
    assert [d.id for d in docs] == [f"h/api/p{i}" for i in (0, 1, 10, 11, *range(2, 10))]
    assert docs[0].text == "Page 0\n\n" + ("Text of page 0. " * 20).strip() and docs[0].source == "h"
    rst = corpus.text_source("r", "pkg", lambda r: corpus._doc(r, "pkg") / "Documentation", "*.rst.gz", ".rst.gz")
    assert [(d.id, d.text) for d in rst.read(tmp_path)] == [("r/a", "Title\n=====\n\nBody.")]


def test_every_source_names_a_known_package_and_held_out_sources_exist():
    names = [s.name for s in corpus.SOURCES]
    assert len(names) == len(set(names))
    assert all(s.package == "bundled" or s.package in corpus.PACKAGES for s in corpus.SOURCES)
    assert {s.name for s in corpus.SOURCES if s.heldout} == {"debian-handbook", "rust-book"}


def test_the_output_layout_trains_and_validates_through_the_loader(tmp_path):
    """``--data.dataset OUT`` reads OUT/train (all shards) for training and OUT/validation for validation."""
    docs = [_doc(i, f"Document {i} has a few words of English text in it. " * 8) for i in range(60)]
    corpus.write_split(tmp_path, "train", docs[:50], 6000)
    corpus.write_split(tmp_path, "validation", docs[50:], 6000)
    assert len(list((tmp_path / "train").iterdir())) > 1
    source = resolve_source(str(tmp_path), split="train", holdout_every=100)
    assert [f.parent.name for f in source.files] == ["train"] * len(source.files) and source.holdout is None
    tokenizer = load_tokenizer("bundled")
    data = Data(dataset=str(tmp_path))
    loader = build_dataloader(data=data, tokenizer=tokenizer, seq_len=64, local_batch_size=2)
    stream = iter(loader)
    batches = [next(stream) for _ in range(3)]
    assert all(tuple(b["input_ids"].shape) == (2, 64) for b in batches)
    validation = build_validation_dataloader(data=data, tokenizer=tokenizer, seq_len=64, local_batch_size=2)
    assert validation.stream.epoch_len < loader.stream.epoch_len / 3
    assert len(list(validation)) >= 1
