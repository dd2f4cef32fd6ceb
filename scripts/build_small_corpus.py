"""Build the larger offline English corpus for the small-scale replication (issue 10).

Usage (on a Debian 12 machine; ``apt-get download`` and ``dpkg-deb -x`` need no root)::

    python scripts/build_small_corpus.py data/small_corpus                  # download, extract, write, count
    python scripts/build_small_corpus.py data/small_corpus --cache DIR      # .deb files and extractions in DIR
    python scripts/build_small_corpus.py data/small_corpus --no-count       # skip the token count
    python scripts/build_small_corpus.py data/small_corpus --gzip           # .jsonl.gz (to carry to a device)

Writes ``OUT_DIR/train.jsonl``, ``OUT_DIR/validation.jsonl`` (one ``{"id", "source", "text"}`` object per line)
and ``OUT_DIR/PROVENANCE.md`` (packages, versions, licences, documents, bytes and tokens of the bundled tokenizer).
Point the trainer at the files, not the folder (a folder without ``train/`` sub-folders reads every file in it)::

    --data.dataset data/small_corpus/train.jsonl --validation.dataset data/small_corpus/validation.jsonl

Sources, each split at its natural unit (see ``hola_titan/assets/corpus/README.md`` for the candidates):

* the bundled corpus (KJV chapters, Devil's Dictionary and Jargon File entries), both splits as they are;
* ``dict-gcide``: one document per entry of the GNU Collaborative International Dictionary of English;
* ``python3.11-doc``: one document per page of the Python documentation sources (reStructuredText);
* ``perl-doc``: one document per ``.pod`` manual page;
* ``sword-comm-tdavid``, ``sword-comm-mhcc``, ``sword-comm-scofield``, ``sword-text-web``: one document per
  chapter (OSIS ``<chapter sID=...>`` milestones) of the SWORD modules, tags removed.

A document is held out for validation when ``sha256(id) % 50 == 0``, the rule of ``build_bundled_data.py``, so the
bundled documents land in the same split as in the bundled corpus. The output depends only on the package
contents: training documents are written in source order, validation documents in ``sha256(id)`` order (training
scores only the split's first batches, which should sample every source), and the script prints the sha256 of each
split.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The bundled corpus's builder beside this script: the same documents, hold-out rule and dictd decoding.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_bundled_data import VALIDATION_MODULUS, Document, dictd_number, is_validation  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLED_CORPUS_DIR = REPO / "hola_titan" / "assets" / "corpus"
TOKENIZER_FILE = REPO / "hola_titan" / "assets" / "tokenizer" / "tokenizer.json"


@dataclass(frozen=True)
class Package:
    version: str
    """The Debian 12 (bookworm) version this script was checked against; another version only warns."""
    licence: str
    """As stated in the package's ``usr/share/doc/<name>/copyright``."""
    content: str


PACKAGES = {
    "dict-gcide": Package("0.48.5+nmu2", "GPL-2+ (GNU Collaborative International Dictionary of English)",
                          "GCIDE: Webster's Revised Unabridged Dictionary (1913) with additions"),
    "python3.11-doc": Package("3.11.2-6+deb12u9", "PSF License (Python documentation)",
                              "Python 3.11 documentation sources (reStructuredText)"),
    "perl-doc": Package("5.36.0-7+deb12u4", "GPL-1+ or Artistic", "Perl 5.36 manual (POD)"),
    "sword-comm-tdavid": Package("2.1-1", "public domain", "C. H. Spurgeon, The Treasury of David (1869-1885)"),
    "sword-comm-mhcc": Package("2.0-1", "public domain (module text; packaging GPL-2+)",
                               "Matthew Henry's Concise Commentary on the Whole Bible"),
    "sword-comm-scofield": Package("2.1-1", "public domain", "Scofield Reference Notes (1917 edition)"),
    "sword-text-web": Package("426.0-1", "public domain (module text; packaging GPL-2+)",
                              "World English Bible with Deuterocanon (footnotes removed)"),
}
"""Debian packages the corpus is extracted from (besides the bundled corpus)."""

SWORD_MODULES = {
    "sword-comm-tdavid": "comments/zcom/tdavid",
    "sword-comm-mhcc": "comments/zcom/mhcc",
    "sword-comm-scofield": "comments/zcom/scofield",
    "sword-text-web": "texts/ztext/engWEB2015eb",
}
"""Module folder under ``usr/share/sword/modules`` of each SWORD package."""


def unique_ids(docs: Iterable[Document]) -> list[Document]:
    """``docs`` with repeated ids made unique by a `` (2)``, `` (3)`` ... suffix, in order."""
    seen: set[str] = set()
    out = []
    for doc in docs:
        doc_id, suffix = doc.id, 2
        while doc_id in seen:
            doc_id, suffix = f"{doc.id} ({suffix})", suffix + 1
        seen.add(doc_id)
        out.append(Document(id=doc_id, source=doc.source, text=doc.text))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Debian packages
# ---------------------------------------------------------------------------------------------------------------


def fetch_packages(cache: Path, names: Iterable[str], packages: dict[str, Package] | None = None) -> dict[str, Path]:
    """``apt-get download`` the missing .deb files into ``cache/debs``; extract each to ``cache/extracted/NAME``.

    ``packages`` (default :data:`PACKAGES`) gives the version each name was checked against.
    """
    packages = PACKAGES if packages is None else packages
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    names = list(names)
    missing = [n for n in names if not list(debs.glob(f"{n}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    roots = {}
    for name in names:
        deb = sorted(debs.glob(f"{name}_*.deb"))[-1]
        version = deb.name.split("_")[1].replace("%3a", ":")
        if version != packages[name].version:
            print(f"warning: {deb.name} is version {version}; this script was checked against "
                  f"{packages[name].version}", file=sys.stderr)
        root = cache / "extracted" / name
        if not (root / ".complete").is_file():
            root.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            (root / ".complete").write_text(version + "\n", encoding="utf-8")
        roots[name] = root
    return roots


def package_version(root: Path) -> str:
    return (root / ".complete").read_text(encoding="utf-8").strip()


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def bundled_documents() -> list[Document]:
    docs = []
    for split in ("train", "validation"):
        with gzip.open(BUNDLED_CORPUS_DIR / f"{split}.jsonl.gz", "rt", encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                docs.append(Document(id=record["id"], source=record["source"], text=record["text"]))
    return docs


def dictd_entries(index_text: str, data: bytes, *, prefix: str, source: str) -> list[Document]:
    """One document per distinct byte range of a dictd dictionary (headwords sharing an entry give one document).

    ``index_text`` is the ``.index`` file (``headword TAB offset TAB length``), ``data`` the uncompressed
    ``.dict``. Header entries (``00database...``) are skipped; the id is ``prefix/<first headword>``.
    """
    ranges: dict[int, tuple[int, str]] = {}
    for line in index_text.splitlines():
        if not line.strip():
            continue
        headword, offset, length = line.split("\t")[:3]
        if headword.startswith("00database") or headword.startswith("00-database"):
            continue
        ranges.setdefault(dictd_number(offset), (dictd_number(length), headword))
    docs = []
    for offset in sorted(ranges):
        length, headword = ranges[offset]
        entry = data[offset:offset + length].decode("utf-8", errors="replace")
        text = "\n".join(line.rstrip() for line in entry.strip("\n").splitlines()).strip()
        if text:
            docs.append(Document(id=f"{prefix}/{headword}", source=source, text=text))
    return unique_ids(docs)


def gcide_documents(root: Path) -> list[Document]:
    folder = root / "usr" / "share" / "dictd"
    data = gzip.decompress((folder / "gcide.dict.dz").read_bytes())  # dictzip files are gzip files
    index = (folder / "gcide.index").read_text(encoding="utf-8", errors="replace")
    return dictd_entries(index, data, prefix="gcide", source="gcide")


def file_documents(files: Iterable[Path], base: Path, *, prefix: str, source: str, suffix: str) -> list[Document]:
    """One document per file (a documentation page), id ``prefix/<path below base without suffix>``.

    A file whose name ends in ``.gz`` is read decompressed (``suffix`` then includes the ``.gz``).
    """
    docs = []
    for path in sorted(files):
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        # Universal newlines, as Path.read_text reads them.
        text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n").strip()
        if text:
            name = path.relative_to(base).as_posix().removesuffix(suffix)
            docs.append(Document(id=f"{prefix}/{name}", source=source, text=text))
    return docs


def python_doc_documents(root: Path) -> list[Document]:
    base = next((root / "usr" / "share" / "doc").glob("python3*/html/_sources"))
    return file_documents(base.rglob("*.rst.txt"), base, prefix="python-doc", source="python-doc",
                          suffix=".rst.txt")


def perl_doc_documents(root: Path) -> list[Document]:
    base = root / "usr" / "share" / "perl"
    return file_documents(base.rglob("*.pod"), base, prefix="perl-doc", source="perl-doc", suffix=".pod")


def sword_blocks(prefix: Path) -> list[str]:
    """Decompressed blocks of a zText/zCom module file pair (``<prefix>s`` index, ``<prefix>z`` data).

    The index holds ``(offset, compressed size, uncompressed size)`` as three little-endian uint32 per block; each
    block is one zlib stream.
    """
    index = prefix.with_name(prefix.name + "s").read_bytes()
    data = prefix.with_name(prefix.name + "z").read_bytes()
    blocks = []
    for start in range(0, len(index), 12):
        offset, size, _ = struct.unpack("<III", index[start:start + 12])
        if size:
            blocks.append(zlib.decompress(data[offset:offset + size]).decode("utf-8", errors="replace"))
    return blocks


_OSIS_BREAK = re.compile(r"<(?:lb|/p|/l|/lg|/item|/title|/row|br)\b[^>]*>|<(?:div|l|p|lg)\b[^>]*eID=[^>]*/>")
_OSIS_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
_OSIS_TAG = re.compile(r"<[^>]*>")
_CHAPTER = re.compile(r'<chapter\b[^>]*\bsID="([^"]+)"[^>]*/?>')


def osis_to_text(osis: str, *, drop_notes: bool) -> str:
    """Plain text of OSIS markup: line breaks at paragraph, line and title ends, other tags removed."""
    if drop_notes:
        osis = _OSIS_NOTE.sub("", osis)
    text = _OSIS_TAG.sub("", _OSIS_BREAK.sub("\n", osis))
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&")):
        text = text.replace(entity, char)
    lines = (re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def split_chapters(block: str) -> list[tuple[str, str]]:
    """``[(osisID, osis)]`` of the chapters of a block, at ``<chapter sID="...">`` milestones.

    Text before the first chapter (a book's introduction) goes with the first chapter; a block without chapter
    milestones is returned whole under the id ``""``.
    """
    marks = list(_CHAPTER.finditer(block))
    if not marks:
        return [("", block)]
    bounds = [0] + [m.start() for m in marks[1:]] + [len(block)]
    return [(m.group(1), block[bounds[i]:bounds[i + 1]]) for i, m in enumerate(marks)]


def sword_documents(root: Path, module: str, *, source: str) -> list[Document]:
    folder = root / "usr" / "share" / "sword" / "modules" / module
    docs = []
    for testament in ("ot", "nt"):
        indexes = sorted(folder.glob(f"{testament}.?zs"))  # ot.bzs (zText, zCom) or ot.czs (zCom4)
        for index in indexes:
            for block_number, block in enumerate(sword_blocks(index.with_suffix(index.suffix[:-1]))):
                for chapter, osis in split_chapters(block):
                    text = osis_to_text(osis, drop_notes=source == "web")
                    if len(text) < 20:  # module headers and empty chapters
                        continue
                    title = chapter or f"{testament}-block-{block_number}"
                    docs.append(Document(id=f"{source}/{title}", source=source, text=text))
    return unique_ids(docs)


SWORD_SOURCES = {"sword-comm-tdavid": "treasury-of-david", "sword-comm-mhcc": "mhcc",
                 "sword-comm-scofield": "scofield", "sword-text-web": "web"}


def all_documents(roots: dict[str, Path]) -> list[Document]:
    docs = bundled_documents()
    docs += gcide_documents(roots["dict-gcide"])
    docs += python_doc_documents(roots["python3.11-doc"])
    docs += perl_doc_documents(roots["perl-doc"])
    for package, module in SWORD_MODULES.items():
        docs += sword_documents(roots[package], module, source=SWORD_SOURCES[package])
    return docs


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def split_documents(docs: list[Document]) -> dict[str, list[Document]]:
    """``train`` in source order; ``validation`` in ``sha256(id)`` order. Training scores only the first
    ``validation.steps`` batches of the validation file: in source order the `small` recipe's 8 batches were 71%
    GCIDE entries and 21% KJV chapters, no manual or commentary text, and half of the split's bytes are one
    commentary (``treasury-of-david``). Hash order makes those first rows a sample of the documents. The training
    file keeps its order (the loader shuffles it), so runs read the same batches as on earlier builds."""
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids are not unique")
    return {"train": [d for d in docs if not is_validation(d.id)],
            "validation": sorted((d for d in docs if is_validation(d.id)),
                                 key=lambda d: hashlib.sha256(d.id.encode("utf-8")).digest())}


def write_jsonl(path: Path, docs: list[Document]) -> str:
    """Write one JSON object per line (``id``, ``source``, ``text``); return the sha256 of the uncompressed text.

    A path ending in ``.gz`` is gzip-compressed with a fixed header (no name, mtime 0), so rebuilds are identical.
    """
    payload = "".join(json.dumps({"id": d.id, "source": d.source, "text": d.text}, ensure_ascii=False) + "\n"
                      for d in docs).encode("utf-8")
    if path.name.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)
    return hashlib.sha256(payload).hexdigest()


def count_tokens(docs: list[Document]) -> list[int]:
    """Tokens of each document with the bundled tokenizer, plus one EOS (as the packed loader counts them)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    counts = []
    for start in range(0, len(docs), 4096):
        batch = tokenizer.encode_batch([d.text for d in docs[start:start + 4096]], add_special_tokens=False)
        counts += [len(e.ids) + 1 for e in batch]
    return counts


def provenance(splits: dict[str, list[Document]], tokens: dict[str, list[int]] | None,
               versions: dict[str, str], digests: dict[str, str]) -> str:
    sources: dict[str, str] = {"kjv": "bundled", "devils-dictionary": "bundled", "jargon-file": "bundled",
                               "gcide": "dict-gcide", "python-doc": "python3.11-doc", "perl-doc": "perl-doc"}
    sources.update({v: k for k, v in SWORD_SOURCES.items()})
    lines = ["# Small-scale replication corpus (issue 10)", "",
             "Built by `scripts/build_small_corpus.py` from Debian 12 packages (downloaded with `apt-get download`, "
             "extracted with `dpkg-deb -x`). Tokens: the bundled 8,192-entry tokenizer, one EOS per document. "
             f"Held out: `sha256(id) % {VALIDATION_MODULUS} == 0`.", "",
             "| package | version | licence | content |", "| --- | --- | --- | --- |",
             "| bundled corpus (`bible-kjv-text`, `dict-devil`, `jargon-text`) | see "
             "`hola_titan/assets/corpus/README.md` | public domain | KJV, The Devil's Dictionary, Jargon File |"]
    for name, package in PACKAGES.items():
        lines.append(f"| `{name}` | {versions.get(name, '?')} | {package.licence} | {package.content} |")
    lines += ["", "| source | package | train docs | validation docs | train MB | validation MB | train tokens "
              "| validation tokens |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for source, package in sources.items():
        row = [f"`{source}`", f"`{package}`"]
        per = {s: [i for i, d in enumerate(splits[s]) if d.source == source] for s in splits}
        row += [f"{len(per['train']):,}", f"{len(per['validation']):,}"]
        row += [f"{sum(len(splits[s][i].text.encode()) for i in per[s]) / 1e6:.2f}" for s in splits]
        row += [f"{sum(tokens[s][i] for i in per[s]):,}" if tokens else "-" for s in splits]
        lines.append("| " + " | ".join(row) + " |")
    total = ["**total**", ""] + [f"{len(splits[s]):,}" for s in splits]
    total += [f"{sum(len(d.text.encode()) for d in splits[s]) / 1e6:.2f}" for s in splits]
    total += [f"{sum(tokens[s]):,}" if tokens else "-" for s in splits]
    lines += ["| " + " | ".join(total) + " |", ""]
    lines += [f"sha256 of the uncompressed `{s}.jsonl`: `{digests[s]}`" for s in splits]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for train.jsonl, validation.jsonl, PROVENANCE.md")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the .deb files and their extraction (default: OUT_DIR/.cache)")
    parser.add_argument("--no-count", action="store_true", help="do not count tokens")
    parser.add_argument("--gzip", action="store_true",
                        help="write train.jsonl.gz / validation.jsonl.gz (about 30 MB instead of 87 MB: small enough "
                             "to carry to a device machine, which has no network)")
    args = parser.parse_args(argv)
    cache = args.cache or args.out_dir / ".cache"
    roots = fetch_packages(cache, PACKAGES)
    splits = split_documents(all_documents(roots))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ".jsonl.gz" if args.gzip else ".jsonl"
    digests = {s: write_jsonl(args.out_dir / f"{s}{suffix}", docs) for s, docs in splits.items()}
    tokens = None if args.no_count else {s: count_tokens(docs) for s, docs in splits.items()}
    versions = {name: package_version(root) for name, root in roots.items()}
    (args.out_dir / "PROVENANCE.md").write_text(provenance(splits, tokens, versions, digests), encoding="utf-8")
    for split, docs in splits.items():
        size = sum(len(d.text.encode()) for d in docs) / 1e6
        count = f", {sum(tokens[split]):,} tokens" if tokens else ""
        print(f"{split}: {len(docs):,} documents, {size:.2f} MB of text{count}, sha256 {digests[split]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
