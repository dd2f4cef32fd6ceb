"""Rebuild the bundled corpus and the bundled tokenizer in ``hola_titan/assets``.

The corpus is made of three public-domain English texts that Debian ships as packages (see
``hola_titan/assets/corpus/README.md`` for provenance and licences):

* ``bible-kjv-text`` (+ the ``bible`` program of ``bible-kjv`` that decodes its compressed text): the King James
  Bible, one document per chapter;
* ``dict-devil``: Ambrose Bierce's *The Devil's Dictionary*, one document per entry;
* ``jargon-text``: the Jargon File 4.4.7 lexicon, one document per entry.

Usage (on a Debian machine; ``apt-get download`` needs no root, ``dpkg-deb`` comes with dpkg)::

    python scripts/build_bundled_data.py               # download the .deb files, rebuild corpus and tokenizer
    python scripts/build_bundled_data.py --debs DIR    # use .deb files already in DIR
    python scripts/build_bundled_data.py --tokenizer-only   # retrain the tokenizer from the committed corpus

Everything is deterministic: the documents, their order and the held-out split depend only on the package
contents (the split on a hash of each document's id), and BPE training is run single-threaded. The script prints
the sha256 of every uncompressed corpus split and of ``tokenizer.json`` so that a rebuild can be compared.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "hola_titan" / "assets"
CORPUS_DIR = ASSETS / "corpus"
TOKENIZER_DIR = ASSETS / "tokenizer"

PACKAGES = {
    "bible-kjv": "4.38",
    "bible-kjv-text": "4.38",
    "dict-devil": "1.0-13.1",
    "jargon-text": "4.4.7-4.1",
}
"""Debian packages the corpus is extracted from, with the versions the committed files were built from."""

VOCAB_SIZE = 8192
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
VALIDATION_MODULUS = 50
"""A document is held out for validation when ``sha256(id) % VALIDATION_MODULUS == 0`` (about 2 %)."""

KJV_BOOKS = [
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"), ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"), ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"),
    ("1Ki", "1 Kings"), ("2Ki", "2 Kings"), ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"), ("Ezra", "Ezra"),
    ("Neh", "Nehemiah"), ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"), ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"), ("Joel", "Joel"),
    ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"), ("Nahum", "Nahum"),
    ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"), ("Mal", "Malachi"),
    ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"), ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"), ("Gal", "Galatians"), ("Eph", "Ephesians"),
    ("Phi", "Philippians"), ("Col", "Colossians"), ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"),
    ("1Tim", "1 Timothy"), ("2Tim", "2 Timothy"), ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"), ("1Jn", "1 John"), ("2Jn", "2 John"),
    ("3Jn", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
]
"""The ``bible`` program's book abbreviations, in canonical order, with the names used in document titles."""


@dataclass(frozen=True)
class Document:
    id: str
    """Unique and stable: ``source/title``; the held-out split is a hash of it."""
    source: str
    text: str


# ---------------------------------------------------------------------------------------------------------------
# Debian packages
# ---------------------------------------------------------------------------------------------------------------


def fetch_packages(debs: Path | None, work: Path) -> dict[str, Path]:
    """Extract each package of :data:`PACKAGES` under ``work/NAME``; download the .deb files when ``debs`` is None."""
    if debs is None:
        debs = work / "debs"
        debs.mkdir()
        subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True)
    roots = {}
    for name, expected in PACKAGES.items():
        found = sorted(debs.glob(f"{name}_*.deb"))
        if not found:
            raise FileNotFoundError(f"no {name}_*.deb in {debs}")
        deb = found[-1]
        version = deb.name.split("_")[1].replace("%3a", ":")
        if version != expected:
            print(f"warning: {deb.name} is version {version}, the committed corpus was built from {expected}")
        root = work / name
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        roots[name] = root
    return roots


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def kjv_documents(roots: dict[str, Path]) -> list[Document]:
    """One document per chapter: a ``Book N`` title line, a blank line, then ``verse text`` lines."""
    program = roots["bible-kjv"] / "usr" / "bin" / "bible"
    data_dir = roots["bible-kjv-text"] / "usr" / "lib"
    # -f turns pretty-printing off: one "Ge1:1 In the beginning ..." line per verse.
    dump = subprocess.run(
        [str(program), "-f", "-p", str(data_dir), "Gen1:1-Rev22:21"],
        check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL,
    ).stdout
    names = dict(KJV_BOOKS)
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in dump.splitlines():
        match = re.fullmatch(r"(\d?[A-Za-z]+)(\d+):(\d+) (.*)", line)
        if match is None:
            raise ValueError(f"unexpected line in the bible dump: {line!r}")
        book, chapter, verse, text = match.groups()
        chapters.setdefault((book, int(chapter)), []).append(f"{verse} {text.strip()}")
    if len(chapters) != 1189 or [b for b, _ in KJV_BOOKS] != list(dict.fromkeys(b for b, _ in chapters)):
        raise ValueError(f"the bible dump has {len(chapters)} chapters (expected 1189) or books out of order")
    docs = []
    for (book, chapter), verses in chapters.items():
        title = f"{names[book]} {chapter}"
        docs.append(Document(id=f"kjv/{title}", source="kjv", text=title + "\n\n" + "\n".join(verses)))
    return docs


def dictd_number(value: str) -> int:
    """Decode a dictd index number (base64 digits, most significant first)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    number = 0
    for char in value:
        number = number * 64 + alphabet.index(char)
    return number


def devil_documents(roots: dict[str, Path]) -> list[Document]:
    """One document per dictionary entry, read through the dictd index (entries are byte ranges of the text)."""
    folder = roots["dict-devil"] / "usr" / "share" / "dictd"
    text = gzip.decompress((folder / "devil.dict.dz").read_bytes())  # dictzip files are gzip files
    ranges = {}
    for line in (folder / "devil.index").read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if headword.startswith("00database"):
            continue
        ranges.setdefault(dictd_number(offset), dictd_number(length))  # several headwords may share an entry
    docs = []
    seen: set[str] = set()
    for offset in sorted(ranges):
        entry = text[offset:offset + ranges[offset]].decode("utf-8")
        entry = "\n".join(line.rstrip() for line in entry.strip("\n").splitlines())
        title = entry.split(",")[0].split("\n")[0].strip()
        doc_id = f"devil/{title}"
        suffix = 2
        while doc_id in seen:
            doc_id, suffix = f"devil/{title} ({suffix})", suffix + 1
        seen.add(doc_id)
        docs.append(Document(id=doc_id, source="devils-dictionary", text=entry))
    return docs


def jargon_documents(roots: dict[str, Path]) -> list[Document]:
    """One document per lexicon entry (``headword: pronunciation, part of speech`` then the definition)."""
    path = roots["jargon-text"] / "usr" / "share" / "doc" / "jargon-text" / "jargon.txt.gz"
    lines = gzip.decompress(path.read_bytes()).decode("utf-8").replace("\u00a0", " ").split("\n")
    head = re.compile(r"^   :(.+?):(.*)$")
    start = next(i for i, line in enumerate(lines) if head.match(line))
    end = next(i for i, line in enumerate(lines) if re.search(r"Part\s+III\.\s+Appendices", line))
    entries: list[list[str]] = []
    for line in lines[start:end]:
        if head.match(line):
            entries.append([])
        entries[-1].append(line[3:] if line.startswith("   ") else line.lstrip(" "))
    docs = []
    for entry in entries:
        match = head.match("   " + entry[0])
        assert match is not None
        title = match.group(1)
        first = f"{title}:{match.group(2)}".rstrip()
        body = "\n".join(line.rstrip() for line in entry[1:]).strip("\n")
        # {word} marks a cross reference in the source; keep the word.
        text = re.sub(r"\{([^{}]*)\}", r"\1", f"{first}\n\n{body}")
        docs.append(Document(id=f"jargon/{title}", source="jargon-file", text=text))
    return docs


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def is_validation(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest(), 16) % VALIDATION_MODULUS == 0


def write_jsonl_gz(path: Path, docs: list[Document]) -> str:
    """Write one JSON object per line (``id``, ``source``, ``text``), gzip with a fixed header; return sha256."""
    payload = "".join(json.dumps({"id": d.id, "source": d.source, "text": d.text}, ensure_ascii=False) + "\n"
                      for d in docs).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as handle:
        handle.write(payload)
    path.write_bytes(buffer.getvalue())
    return hashlib.sha256(payload).hexdigest()


def build_corpus(debs: Path | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        roots = fetch_packages(debs, Path(tmp))
        docs = kjv_documents(roots) + devil_documents(roots) + jargon_documents(roots)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids are not unique")
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    splits = {"train": [d for d in docs if not is_validation(d.id)],
              "validation": [d for d in docs if is_validation(d.id)]}
    for split, split_docs in splits.items():
        digest = write_jsonl_gz(CORPUS_DIR / f"{split}.jsonl.gz", split_docs)
        size = sum(len(d.text.encode("utf-8")) for d in split_docs)
        by_source = {s: sum(d.source == s for d in split_docs) for s in dict.fromkeys(d.source for d in docs)}
        print(f"{split}: {len(split_docs)} documents {by_source}, {size / 1e6:.3f} MB of text, sha256 {digest}")


def read_split(split: str) -> list[str]:
    with gzip.open(CORPUS_DIR / f"{split}.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def build_tokenizer() -> None:
    """Byte-level BPE with 8192 entries: ``<|endoftext|>`` = 0, ``<|pad|>`` = 1, the 256 bytes, then merges."""
    # Single-threaded training so that ties between equally frequent pairs resolve the same way on every machine.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = read_split("train")
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise ValueError(f"trained vocabulary has {tokenizer.get_vocab_size()} entries, expected {VOCAB_SIZE}")

    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(TOKENIZER_DIR / "tokenizer.json"))
    # The two files transformers reads beside tokenizer.json (AutoTokenizer / PreTrainedTokenizerFast).
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (TOKENIZER_DIR / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (TOKENIZER_DIR / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")

    digest = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()
    print(f"tokenizer.json: vocabulary {tokenizer.get_vocab_size()}, sha256 {digest}")
    for split in ("train", "validation"):
        split_texts = read_split(split)
        lengths = [len(e.ids) + 1 for e in tokenizer.encode_batch(split_texts, add_special_tokens=False)]
        short = sum(n < 256 for n in lengths)
        print(f"{split}: {sum(lengths)} tokens with one EOS per document; {short} of {len(lengths)} documents "
              f"shorter than 256 tokens; longest {max(lengths)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--debs", type=Path, default=None, help="folder with the .deb files (default: download)")
    parser.add_argument("--tokenizer-only", action="store_true", help="retrain the tokenizer from the corpus")
    args = parser.parse_args(argv)
    if not args.tokenizer_only:
        build_corpus(args.debs)
    build_tokenizer()


if __name__ == "__main__":
    sys.exit(main())
