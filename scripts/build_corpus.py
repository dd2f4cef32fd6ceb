"""Build the 100M-token offline English corpus: the small corpus's sources plus Debian documentation and dictionaries.

Usage (on a Debian 12 machine; ``apt-get download`` and ``dpkg-deb -x`` need no root)::

    python scripts/build_corpus.py data/corpus_100m                  # download, extract, write, count
    python scripts/build_corpus.py data/corpus_100m --cache DIR      # .deb files and extractions in DIR
    python scripts/build_corpus.py data/corpus_100m --no-count       # skip the token count

Writes, under ``OUT_DIR`` (one ``{"id", "source", "text"}`` object per line, gzip with a fixed header)::

    train/part-00000.jsonl.gz ...     training documents, in shards of at most --shard-mb MB of JSON each
    validation/part-00000.jsonl.gz    sha256(id) % 50 == 0 of the training sources (the small corpus's rule)
    heldout/part-00000.jsonl.gz       "Wikitext-like": whole sources never trained on (long-form edited prose)
    PROVENANCE.md                     packages, versions, licences, documents, bytes, tokens, sha256 of every file

Train on ``--data.dataset OUT_DIR`` (its ``train/`` and ``validation/`` folders are the two splits) and measure the
held-out split with ``python -m hola_titan.eval ppl --data OUT_DIR --split heldout``.

Sources (each split at its natural unit; ``PACKAGES`` and ``SOURCES`` below list them with their licences):

* everything of ``build_small_corpus.py`` (bundled corpus, GCIDE, Python and Perl manuals, SWORD modules);
* documentation pages: HTML converted to text (scripts, styles, navigation and page furniture dropped), or the
  reStructuredText / Markdown / AsciiDoc / Vim-help sources kept as they are where a package ships them;
* dictd dictionaries (WordNet, FOLDOC, V.E.R.A.): one document per entry.

Cleaning: lines that recur on at least a fifth of a converted HTML source's pages (menus, footers, "previous /
next" bars) are removed, and pages shorter than ``MIN_CHARS`` dropped; exact duplicates (the same text after
whitespace is collapsed and case folded) are kept once, the first in source order, and never in train when a
held-out document has the same text. A source larger than ``MAX_SHARE`` of the corpus's text is cut to that share by
keeping the documents with the smallest ``sha256(id)``. Training and validation documents are written in
``sha256(id)`` order, so every shard, and the first rows of validation that training scores, is a sample of the
whole mix. The output depends only on the package contents; the script prints the
sha256 of every file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_small_corpus as small  # noqa: E402
from build_bundled_data import VALIDATION_MODULUS, Document, is_validation  # noqa: E402
from build_small_corpus import Package  # noqa: E402

MIN_CHARS = 200
"""Shorter converted HTML pages are dropped: redirect stubs and empty index pages (dictionary entries are kept)."""
MAX_SHARE = 0.35
"""No source may hold more than this share of the corpus's text (UTF-8 bytes, which track tokens closely)."""
BOILERPLATE_SHARE = 0.2
"""A line is page furniture when it recurs on at least this share of one HTML source's pages ..."""
BOILERPLATE_MIN_PAGES = 10
"""... and on at least this many of them."""
SHARD_MB = 160
"""Uncompressed JSON per training shard; documentation text gzips about 3.5:1, so a shard is about 45 MiB."""
MAX_FILE_MIB = 55
"""Largest gzip file written: files have to fit one transfer (60 MiB) to a device machine."""

PACKAGES = {
    **small.PACKAGES,
    "linux-doc-6.1": Package("6.1.192-3", "GPL-2", "Linux 6.1 kernel documentation (reStructuredText sources)"),
    "rust-doc": Package("1.63.0+dfsg1-2", "MIT or Apache-2.0",
                        "Rust 1.63 standard library reference and the Rust books (The Rust Programming Language, "
                        "the Reference, the Rustonomicon, Rust by Example, ...)"),
    "openjdk-17-doc": Package("17.0.21.1+2-1~deb12u1", "GPL-2 with Classpath exception",
                              "Java SE 17 API specification (Javadoc)"),
    "erlang-doc": Package("1:25.2.3+dfsg-1+deb12u4", "Apache-2.0",
                          "Erlang/OTP 25 documentation (system guides and reference manuals)"),
    "ghc-doc": Package("9.0.2-4", "BSD-3-clause",
                       "GHC 9.0 User's Guide and the Haddock reference of its bundled Haskell libraries"),
    "python-pandas-doc": Package("1.5.3+dfsg-2", "BSD-3", "pandas 1.5 documentation (user guide and API reference)"),
    "python-scipy-doc": Package("1.10.1-2", "BSD-3-clause", "SciPy 1.10 documentation"),
    "python-sympy-doc": Package("1.11.1-1", "BSD-3-clause", "SymPy 1.11 documentation"),
    "python-django-doc": Package("3:3.2.25-0+deb12u7", "BSD-3-Clause", "Django 3.2 documentation"),
    "python-sqlalchemy-doc": Package("1.4.46+ds1-1", "Expat", "SQLAlchemy 1.4 documentation (reStructuredText)"),
    "qtbase5-doc-html": Package("5.15.8+dfsg-11+deb12u3", "GFDL-NIV-1.3 (documentation)",
                                "Qt 5.15 base module documentation"),
    "libboost1.74-doc": Package("1.74.0+ds1-21", "BSL-1.0", "Boost 1.74 C++ library documentation"),
    "postgresql-doc-15": Package("15.20-0+deb12u1", "PostgreSQL", "PostgreSQL 15 manual"),
    "llvm-15-doc": Package("1:15.0.6-4", "Apache-2.0 with LLVM exceptions",
                           "LLVM 15 documentation (reStructuredText sources)"),
    "clang-15-doc": Package("1:15.0.6-4", "Apache-2.0 with LLVM exceptions",
                            "Clang 15 documentation (reStructuredText sources)"),
    "cmake-doc": Package("3.25.1-1", "BSD-3-clause", "CMake 3.25 documentation (reStructuredText sources)"),
    "sphinx-doc": Package("5.3.0-4", "BSD-2-clause", "Sphinx 5.3 documentation (reStructuredText sources)"),
    "apache2-doc": Package("2.4.71-1~deb12u1", "Apache-2.0", "Apache HTTP Server 2.4 manual (English pages)"),
    "libreoffice-help-en-us": Package("4:7.4.7-1+deb12u14", "MPL-2.0", "LibreOffice 7.4 help (en-US)"),
    "octave-doc": Package("7.3.0-2", "GPL-3+", "GNU Octave 7.3 manual"),
    "git-doc": Package("1:2.39.5-0+deb12u3", "GPL-2", "Git 2.39 manual pages and guides (AsciiDoc sources)"),
    "vim-runtime": Package("2:9.0.1378-2+deb12u2", "Vim (GPL-compatible)", "Vim 9.0 help files"),
    "nodejs-doc": Package("18.20.4+dfsg-1~deb12u3", "Expat", "Node.js 18 API documentation (Markdown)"),
    "debian-reference-en": Package("2.100", "GPL-2+", "Osamu Aoki, Debian Reference (English)"),
    "debian-policy": Package("4.6.2.0", "GPL-2+", "Debian Policy Manual (reStructuredText sources)"),
    "abs-guide": Package("10-4", "public domain", "Mendel Cooper, Advanced Bash-Scripting Guide"),
    "dict-wn": Package("1:3.0-37", "WordNet 3.0 licence (BSD-like)", "WordNet 3.0 glosses and examples"),
    "dict-foldoc": Package("20230119-1", "GFDL-1.1+, no invariant sections",
                           "FOLDOC, the Free On-line Dictionary of Computing"),
    "dict-vera": Package("1:1.24-1", "GFDL-NIV-1.1+", "V.E.R.A., Virtual Entity of Relevant Acronyms"),
    "debian-handbook": Package("11.20220922", "GPL-2.0+ or CC-BY-SA-3.0",
                               "Raphael Hertzog and Roland Mas, The Debian Administrator's Handbook (English)"),
}
"""Debian packages the corpus is extracted from (besides the bundled corpus)."""


# ---------------------------------------------------------------------------------------------------------------
# HTML to text
# ---------------------------------------------------------------------------------------------------------------

_SKIP_TAGS = {"script", "style", "head", "title", "nav", "noscript", "svg", "button", "select", "textarea",
              "template", "form"}
_SKIP_ROLES = {"navigation", "search", "banner", "contentinfo", "complementary"}
_SKIP_CLASSES = {"headerlink", "sphinxsidebar", "related", "toc-backref", "skip-nav", "sub-nav", "top-nav"}
"""Sphinx's pilcrow anchors and sidebars, Javadoc's skip links: never part of the page's own text."""
_VOID = {"br", "hr", "img", "meta", "link", "input", "wbr", "area", "base", "col", "embed", "source", "track",
         "param"}
_BLOCK = {"p", "div", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "section", "article", "blockquote", "pre",
          "main", "header", "footer", "aside", "figure", "figcaption", "caption", "details", "summary", "fieldset",
          "address", "center", "tbody", "thead"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_PRE_NEWLINE = "\x00"
"""Stands for a newline inside ``<pre>`` until lines are cleaned (those keep their indentation)."""


class _TextParser(HTMLParser):
    """Collects a page's text twice: all of it, and what lies in its main region (``<main>``, ``role="main"``,
    ``itemprop="articleBody"``, ``id="main-content"``), which leaves out headers and sidebars where a page marks it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.all: list[str] = []
        self.main: list[str] = []
        self._skip: list = []  # [tag, depth] of the outermost skipped element
        self._in_main: list = []
        self._pre = 0

    def _emit(self, text: str) -> None:
        self.all.append(text)
        if self._in_main:
            self.main.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip:
            # Only the skipped tag's own nesting is counted: other tags may be left unclosed in HTML.
            if tag == self._skip[0] and tag not in _VOID:
                self._skip[1] += 1
            return
        values = dict(attrs)
        classes = set((values.get("class") or "").split())
        if (tag in _SKIP_TAGS or values.get("role") in _SKIP_ROLES or classes & _SKIP_CLASSES
                or "hidden" in values):
            if tag not in _VOID:
                self._skip = [tag, 1]
            return
        if self._in_main:
            if tag == self._in_main[0] and tag not in _VOID:
                self._in_main[1] += 1
        elif (tag == "main" or values.get("role") == "main" or values.get("itemprop") == "articleBody"
              or values.get("id") == "main-content"):
            self._in_main = [tag, 1]
        if tag == "pre":
            self._pre += 1
        if tag in _HEADINGS:
            self._emit("\n\n")
        elif tag in _BLOCK or tag in ("br", "hr"):
            self._emit("\n")
        elif tag in ("td", "th"):
            self._emit(" ")
        if tag == "li":
            self._emit("- ")

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            if tag == self._skip[0]:
                self._skip[1] -= 1
                if self._skip[1] == 0:
                    self._skip = []
            return
        if tag == "pre" and self._pre:
            self._pre -= 1
        if tag in _HEADINGS:
            self._emit("\n\n")
        elif tag in _BLOCK:
            self._emit("\n")
        if self._in_main and tag == self._in_main[0]:
            self._in_main[1] -= 1
            if self._in_main[1] == 0:
                self._in_main = []

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._pre:
            self._emit(data.replace("\r\n", "\n").replace("\n", _PRE_NEWLINE))
        else:
            self._emit(re.sub(r"\s+", " ", data))


def html_to_text(markup: str) -> str:
    """Plain text of an HTML page: its main region where it marks one, else its whole body.

    Block elements start new lines, headings are set off by blank lines, list items start with ``- ``, table cells
    are separated by spaces, ``<pre>`` keeps its line breaks and indentation; elsewhere runs of white space become
    one space. Scripts, styles, navigation, forms and Sphinx's pilcrow links are dropped.
    """
    parser = _TextParser()
    parser.feed(markup)
    parser.close()
    text = "".join(parser.main) or "".join(parser.all)
    lines = []
    for line in text.replace("\u00a0", " ").split("\n"):
        if _PRE_NEWLINE in line:
            lines += [part.rstrip() for part in line.split(_PRE_NEWLINE)]
        elif line.strip() != "-":  # a list item with no text of its own (Javadoc wraps blocks in them)
            lines.append(line.strip())
        else:
            lines.append("")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _page_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    return html_to_text(raw.decode("utf-8", errors="replace"))


_POOL: multiprocessing.pool.Pool | None = None
"""Worker processes for the HTML conversion, which is most of the build's time (main sets it)."""


def html_documents(files: Iterable[Path], base: Path, *, prefix: str, source: str) -> list[Document]:
    """One document per HTML page, id ``prefix/<path below base without .html>``, furniture lines removed; pages
    with less than :data:`MIN_CHARS` of text left are dropped."""
    files = sorted(files)
    texts = _POOL.map(_page_text, files, chunksize=8) if _POOL else [_page_text(f) for f in files]
    docs = [Document(id=f"{prefix}/{path.relative_to(base).as_posix().removesuffix('.html')}", source=source,
                     text=text) for path, text in zip(files, texts) if text]
    return [d for d in drop_boilerplate_lines(docs) if len(d.text) >= MIN_CHARS]


def drop_boilerplate_lines(docs: list[Document], *, share: float = BOILERPLATE_SHARE,
                           min_pages: int = BOILERPLATE_MIN_PAGES) -> list[Document]:
    """``docs`` without the lines that recur on at least ``share`` of them (and at least ``min_pages``).

    Lines without a letter (a closing brace in a code example, a rule) are always kept; blank-line runs left behind
    are closed up.
    """
    counts: Counter[str] = Counter()
    for doc in docs:
        counts.update({line.strip() for line in doc.text.split("\n") if line.strip()})
    limit = max(min_pages, share * len(docs))
    furniture = {line for line, n in counts.items() if n >= limit and re.search(r"[^\W\d_]", line)}
    if not furniture:
        return docs
    out = []
    for doc in docs:
        kept = "\n".join(line for line in doc.text.split("\n") if line.strip() not in furniture)
        out.append(Document(id=doc.id, source=doc.source, text=re.sub(r"\n{3,}", "\n\n", kept).strip()))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    """The ``source`` field of its documents."""
    package: str
    read: Callable[[Path], list[Document]]
    """Documents from the package's extracted root."""
    heldout: bool = False
    """All of its documents go to the held-out split, none to train or validation."""


def _doc(root: Path, package: str) -> Path:
    return root / "usr" / "share" / "doc" / package


def _pages(base: Path, exclude: str | None = None, pattern: str = "*.html") -> list[Path]:
    """Files below ``base`` matching ``pattern`` whose path below ``base`` does not match the ``exclude`` regex."""
    return [p for p in base.rglob(pattern)
            if p.is_file() and not (exclude and re.search(exclude, p.relative_to(base).as_posix()))]


def html_source(name: str, package: str, where: Callable[[Path], Path], exclude: str | None = None,
                **kwargs) -> Source:
    """A source of HTML pages below ``where(root)``, minus the paths that match ``exclude``."""
    def read(root: Path) -> list[Document]:
        base = where(root)
        return html_documents(_pages(base, exclude), base, prefix=name, source=name)
    return Source(name, package, read, **kwargs)


def text_source(name: str, package: str, where: Callable[[Path], Path], pattern: str, suffix: str,
                exclude: str | None = None) -> Source:
    """A source of markup files kept as they are (reStructuredText, Markdown, AsciiDoc, Vim help)."""
    def read(root: Path) -> list[Document]:
        base = where(root)
        return small.file_documents(_pages(base, exclude, pattern), base, prefix=name, source=name, suffix=suffix)
    return Source(name, package, read)


def dictd_source(name: str, package: str, dictionary: str) -> Source:
    def read(root: Path) -> list[Document]:
        folder = root / "usr" / "share" / "dictd"
        data = gzip.decompress((folder / f"{dictionary}.dict.dz").read_bytes())
        index = (folder / f"{dictionary}.index").read_text(encoding="utf-8", errors="replace")
        return small.dictd_entries(index, data, prefix=name, source=name)
    return Source(name, package, read)


def _small_sources() -> list[Source]:
    """The sources of ``build_small_corpus.py``, read by its functions."""
    sources = [Source("bundled", "bundled", lambda root: small.bundled_documents()),
               Source("gcide", "dict-gcide", small.gcide_documents),
               Source("python-doc", "python3.11-doc", small.python_doc_documents),
               Source("perl-doc", "perl-doc", small.perl_doc_documents)]
    for package, module in small.SWORD_MODULES.items():
        name = small.SWORD_SOURCES[package]
        sources.append(Source(name, package, lambda root, m=module, n=name: small.sword_documents(root, m, source=n)))
    return sources


SPHINX_SOURCES = "html/_sources"

SOURCES = _small_sources() + [
    text_source("linux-doc", "linux-doc-6.1", lambda r: _doc(r, "linux-doc-6.1") / "Documentation", "*.rst.gz",
                ".rst.gz", exclude=r"^translations/"),
    # The standard library (core and alloc repeat it) and the books but The Rust Programming Language (held out);
    # not the source listings, the thousands of one-line SIMD intrinsic pages of std::arch, or each book's
    # print.html (all its chapters again on one page).
    html_source("rust-doc", "rust-doc", lambda r: _doc(r, "rust-doc") / "html",
                exclude=r"^(src|core|alloc|implementors|test|proc_macro|book)/|^std/arch/|^[^/]+\.html$|"
                        r"(^|/)print\.html$"),
    # Class, interface and package pages; not the generated indexes, trees and "uses of" lists.
    html_source("javadoc", "openjdk-17-doc", lambda r: _doc(r, "openjdk-17-jre-headless") / "api",
                exclude=r"(^|/)(class-use|index-files|legal)/|-tree\.html$|^(all|deprecated|help|search|index|"
                        r"overview|constant-values|serialized-form|system-properties|external-specs)"),
    html_source("erlang-doc", "erlang-doc", lambda r: _doc(r, "erlang-doc")),
    html_source("ghc-doc", "ghc-doc", lambda r: _doc(r, "ghc-doc") / "html", exclude=r"/src/|doc-index"),
    html_source("pandas-doc", "python-pandas-doc", lambda r: _doc(r, "python-pandas-doc") / "html",
                exclude=r"^_modules/|^genindex|^search"),
    html_source("scipy-doc", "python-scipy-doc", lambda r: _doc(r, "python-scipy-doc") / "html",
                exclude=r"^_modules/|^genindex|^search"),
    html_source("sympy-doc", "python-sympy-doc", lambda r: _doc(r, "python-sympy-doc") / "html",
                exclude=r"^_modules/|^genindex|^search"),
    html_source("django-doc", "python-django-doc", lambda r: _doc(r, "python-django-doc") / "html",
                exclude=r"^_modules/|^genindex|^search|^py-modindex"),
    text_source("sqlalchemy-doc", "python-sqlalchemy-doc", lambda r: _doc(r, "python-sqlalchemy-doc") / "rst",
                "*.rst", ".rst"),
    html_source("qt-doc", "qtbase5-doc-html", lambda r: r / "usr" / "share" / "qt5" / "doc",
                exclude=r"-(members|obsolete)\.html$"),
    html_source("boost-doc", "libboost1.74-doc", lambda r: _doc(r, "libboost1.74-doc")),
    html_source("postgresql-doc", "postgresql-doc-15", lambda r: _doc(r, "postgresql-doc-15") / "html"),
    text_source("llvm-doc", "llvm-15-doc", lambda r: _doc(r, "llvm-15-doc") / SPHINX_SOURCES, "*.txt", ".txt"),
    text_source("clang-doc", "clang-15-doc", lambda r: _doc(r, "clang-15") / SPHINX_SOURCES, "*.txt", ".txt"),
    text_source("cmake-doc", "cmake-doc", lambda r: _doc(r, "cmake-data") / SPHINX_SOURCES, "*.txt", ".txt"),
    text_source("sphinx-doc", "sphinx-doc", lambda r: _doc(r, "sphinx-doc") / SPHINX_SOURCES, "*.txt", ".txt"),
    html_source("apache-doc", "apache2-doc", lambda r: _doc(r, "apache2-doc") / "manual" / "en"),
    html_source("libreoffice-help", "libreoffice-help-en-us",
                lambda r: r / "usr" / "share" / "libreoffice" / "help" / "en-US"),
    html_source("octave-doc", "octave-doc", lambda r: _doc(r, "octave")),
    text_source("git-doc", "git-doc", lambda r: _doc(r, "git-doc"), "*.txt", ".txt"),
    text_source("vim-help", "vim-runtime", lambda r: r / "usr" / "share" / "vim" / "vim90" / "doc", "*.txt", ".txt"),
    text_source("nodejs-doc", "nodejs-doc", lambda r: _doc(r, "nodejs") / "api", "*.md.gz", ".md.gz"),
    html_source("debian-reference", "debian-reference-en", lambda r: r / "usr" / "share" / "debian-reference",
                exclude=r"^index\."),
    text_source("debian-policy", "debian-policy", lambda r: _doc(r, "debian-policy") / "policy.html" / "_sources",
                "*.txt", ".txt"),
    html_source("abs-guide", "abs-guide", lambda r: _doc(r, "abs-guide") / "html"),
    dictd_source("wordnet", "dict-wn", "wn"),
    dictd_source("foldoc", "dict-foldoc", "foldoc"),
    dictd_source("vera", "dict-vera", "vera"),
    # Held out: two edited books of long-form expository prose, the nearest thing to Wikipedia articles here.
    html_source("debian-handbook", "debian-handbook", lambda r: _doc(r, "debian-handbook") / "html" / "en-US",
                heldout=True),
    html_source("rust-book", "rust-doc", lambda r: _doc(r, "rust-doc") / "html" / "book",
                exclude=r"(^|/)print\.html$", heldout=True),
]
"""Every source, in the order documents are read (earlier ones win exact-duplicate ties)."""


# ---------------------------------------------------------------------------------------------------------------
# Cleaning, splitting, sharding
# ---------------------------------------------------------------------------------------------------------------


def normalised(text: str) -> str:
    """What two documents must share to count as duplicates: the words, case folded, white space ignored."""
    return " ".join(text.casefold().split())


def deduplicate(docs: list[Document], heldout_sources: set[str]) -> tuple[list[Document], Counter[str]]:
    """``docs`` without exact duplicates (:func:`normalised` text), and the number dropped per source.

    The first copy in order is kept, except that a held-out document always wins over training copies of its
    text: held-out text must never be trained on.
    """
    digest = {id(d): hashlib.sha256(normalised(d.text).encode("utf-8")).digest() for d in docs}
    held = {digest[id(d)] for d in docs if d.source in heldout_sources}
    seen: set[bytes] = set()
    kept, dropped = [], Counter()
    for doc in docs:
        key = digest[id(doc)]
        if key in seen or (doc.source not in heldout_sources and key in held):
            dropped[doc.source] += 1
            continue
        seen.add(key)
        kept.append(doc)
    return kept, dropped


def source_caps(sizes: dict[str, int], share: float) -> dict[str, int]:
    """The largest size each source may keep so that none holds more than ``share`` of the capped total.

    Sources over the cap are cut to one common size ``c`` with ``c = share * (k * c + rest)``, ``k`` the number of
    capped sources and ``rest`` the others' total; sources are capped largest first until the rest fit.
    """
    order = sorted(sizes, key=lambda s: (-sizes[s], s))
    caps = dict(sizes)
    for k in range(1, len(order) + 1):
        rest = sum(sizes[s] for s in order[k:])
        if k * share >= 1:
            break
        cap = int(share * rest / (1 - k * share))
        if sizes[order[k - 1]] <= cap:
            break
        for name in order[:k]:
            caps[name] = cap
    return caps


def _id_hash(doc: Document) -> bytes:
    return hashlib.sha256(doc.id.encode("utf-8")).digest()


def apply_caps(docs: list[Document], caps: dict[str, int]) -> tuple[list[Document], Counter[str]]:
    """Keep, of each source over its cap, the documents of smallest ``sha256(id)`` that fit in it (source order
    is kept); return the documents and the number dropped per source."""
    sizes = Counter()
    for doc in docs:
        sizes[doc.source] += len(doc.text.encode("utf-8"))
    keep: set[str] = set()
    for name in (s for s in sizes if sizes[s] > caps.get(s, sizes[s])):
        used = 0
        for doc in sorted((d for d in docs if d.source == name), key=_id_hash):
            size = len(doc.text.encode("utf-8"))
            if used + size > caps[name]:
                continue
            used += size
            keep.add(doc.id)
    out, dropped = [], Counter()
    for doc in docs:
        if sizes[doc.source] > caps.get(doc.source, sizes[doc.source]) and doc.id not in keep:
            dropped[doc.source] += 1
        else:
            out.append(doc)
    return out, dropped


def split_documents(docs: list[Document], heldout_sources: set[str]) -> dict[str, list[Document]]:
    """``train`` and ``validation`` in ``sha256(id)`` order, ``heldout`` in source order.

    Validation is mixed too because training's validation reads only its first rows (``validation.steps`` global
    batches): in source order the 46M recipe's 8 batches were half one 1.4 MB commentary and a third dictionary
    entries, a slice whose loss swung with whatever the last training steps happened to hold.
    """
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids are not unique")
    heldout = [d for d in docs if d.source in heldout_sources]
    rest = [d for d in docs if d.source not in heldout_sources]
    return {"train": sorted((d for d in rest if not is_validation(d.id)), key=_id_hash),
            "validation": sorted((d for d in rest if is_validation(d.id)), key=_id_hash),
            "heldout": heldout}


def _line(doc: Document) -> bytes:
    return (json.dumps({"id": doc.id, "source": doc.source, "text": doc.text}, ensure_ascii=False) + "\n").encode()


def shard_documents(docs: list[Document], max_bytes: int) -> list[list[Document]]:
    """Consecutive runs of ``docs`` of about equal size whose JSON lines add up to at most ``max_bytes`` each (a
    longer document alone): the fewest shards for which cutting at equal byte offsets stays under the budget."""
    sizes = [len(_line(d)) for d in docs]
    total = sum(sizes)
    count = max(1, -(-total // max_bytes))
    while docs:
        target = total / count
        shards: list[list[Document]] = [[] for _ in range(count)]
        used = [0] * count
        offset = 0
        for doc, size in zip(docs, sizes):
            # A document belongs to the shard in which it starts.
            index = min(count - 1, int(offset // target))
            shards[index].append(doc)
            used[index] += size
            offset += size
        if all(n <= max_bytes or len(s) == 1 for n, s in zip(used, shards)):
            return [s for s in shards if s]
        count += 1
    return []


@dataclass(frozen=True)
class Written:
    path: str
    """Relative to the output folder."""
    documents: int
    text_sha256: str
    """Of the uncompressed JSON lines."""
    file_sha256: str
    file_bytes: int


def write_split(out_dir: Path, split: str, docs: list[Document], max_bytes: int) -> list[Written]:
    """Write ``out_dir/split/part-NNNNN.jsonl.gz``; refuse a shard whose gzip file exceeds :data:`MAX_FILE_MIB`."""
    folder = out_dir / split
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("part-*.jsonl.gz"):  # a rebuild with fewer shards must not leave old ones behind
        stale.unlink()
    written = []
    for number, shard in enumerate(shard_documents(docs, max_bytes)):
        path = folder / f"part-{number:05d}.jsonl.gz"
        digest = small.write_jsonl(path, shard)
        data = path.read_bytes()
        if len(data) > MAX_FILE_MIB << 20:
            raise ValueError(f"{path} is {len(data) / 2**20:.1f} MiB, over {MAX_FILE_MIB} MiB: lower --shard-mb")
        written.append(Written(path.relative_to(out_dir).as_posix(), len(shard), digest,
                               hashlib.sha256(data).hexdigest(), len(data)))
    return written


# ---------------------------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------------------------


def _licence_row(name: str, version: str) -> str:
    if name == "bundled":
        return ("| bundled corpus (`bible-kjv-text`, `dict-devil`, `jargon-text`) | see "
                "`hola_titan/assets/corpus/README.md` | public domain | KJV, The Devil's Dictionary, Jargon File |")
    package = PACKAGES[name]
    return f"| `{name}` | {version} | {package.licence} | {package.content} |"


BUNDLED_NAMES = ("kjv", "devils-dictionary", "jargon-file")
"""The ``source`` fields of the bundled corpus's documents (one :class:`Source` reads all three)."""


def _source_of(doc: Document) -> str:
    return "bundled" if doc.source in BUNDLED_NAMES else doc.source


def provenance(splits: dict[str, list[Document]], tokens: dict[str, list[int]] | None, versions: dict[str, str],
               files: dict[str, list[Written]], dropped: dict[str, Counter[str]], seconds: dict[str, float]) -> str:
    docs: Counter[tuple[str, str]] = Counter()
    size: Counter[tuple[str, str]] = Counter()
    toks: Counter[tuple[str, str]] = Counter()
    for split, split_docs in splits.items():
        for index, doc in enumerate(split_docs):
            key = (split, _source_of(doc))
            docs[key] += 1
            size[key] += len(doc.text.encode("utf-8"))
            toks[key] += tokens[split][index] if tokens else 0

    def cells(split: str, names: list[str]) -> list[str]:
        count = sum(toks[split, n] for n in names)
        return [f"{sum(docs[split, n] for n in names):,}", f"{sum(size[split, n] for n in names) / 1e6:.2f}",
                f"{count:,}" if tokens else "-"]

    names = [s.name for s in SOURCES]
    train_text = sum(size["train", n] for n in names) or 1
    lines = ["# Offline English corpus, about 100M tokens", "",
             "Built by `scripts/build_corpus.py` from Debian 12 packages (downloaded with `apt-get download`, "
             "extracted with `dpkg-deb -x`). Tokens: the bundled 8,192-entry tokenizer, one EOS per document. "
             f"Validation: `sha256(id) % {VALIDATION_MODULUS} == 0` of the training sources. Held out: whole "
             "sources (never in train or validation). Licences as stated in each package's "
             "`usr/share/doc/<package>/copyright`.", "",
             "| package | version | licence | content |", "| --- | --- | --- | --- |"]
    lines += [_licence_row(p, versions.get(p, "?")) for p in dict.fromkeys(s.package for s in SOURCES)]
    lines += ["", "| source | package | " + " | ".join(f"{s} docs | {s} MB | {s} tokens" for s in splits)
              + " | share of train text | duplicates dropped | dropped by the cap |",
              "| --- | --- | " + " | ".join("---: | ---: | ---:" for _ in splits) + " | ---: | ---: | ---: |"]
    for source in SOURCES:
        row = [f"`{source.name}`", f"`{source.package}`"]
        for split in splits:
            row += cells(split, [source.name])
        row.append(f"{100 * size['train', source.name] / train_text:.1f}%")
        row += [f"{sum(dropped[k][n] for n in (BUNDLED_NAMES if source.name == 'bundled' else [source.name])):,}"
                for k in ("duplicates", "cap")]
        lines.append("| " + " | ".join(row) + " |")
    total = ["**total**", ""]
    for split in splits:
        total += cells(split, names)
    total += ["100%", f"{sum(dropped['duplicates'].values()):,}", f"{sum(dropped['cap'].values()):,}"]
    lines += ["| " + " | ".join(total) + " |", "",
              "| file | documents | gzip bytes | sha256 of the file | sha256 of the uncompressed JSON lines |",
              "| --- | ---: | ---: | --- | --- |"]
    for written in (w for split in files.values() for w in split):
        lines.append(f"| `{written.path}` | {written.documents:,} | {written.file_bytes:,} | `{written.file_sha256}` "
                     f"| `{written.text_sha256}` |")
    lines += ["", "Build times on the machine that wrote this file: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def read_all(roots: dict[str, Path]) -> list[Document]:
    docs: list[Document] = []
    for source in SOURCES:
        start = time.perf_counter()
        found = source.read(roots.get(source.package, Path()))
        docs += found
        size = sum(len(d.text.encode()) for d in found) / 1e6
        print(f"{source.name}: {len(found):,} documents, {size:.1f} MB ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return small.unique_ids(docs)


def main(argv: list[str] | None = None) -> int:
    global _POOL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for train/, validation/, heldout/ and PROVENANCE.md")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the .deb files and their extraction (default: OUT_DIR/.cache)")
    parser.add_argument("--no-count", action="store_true", help="do not count tokens")
    parser.add_argument("--shard-mb", type=int, default=SHARD_MB,
                        help=f"uncompressed JSON per training shard in MB (default {SHARD_MB}; each gzip file must "
                             f"stay under {MAX_FILE_MIB} MiB)")
    parser.add_argument("--jobs", type=int, default=None, help="processes for the HTML conversion (default: cores)")
    args = parser.parse_args(argv)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    cache = args.cache or args.out_dir / ".cache"
    names = [s.package for s in SOURCES if s.package != "bundled"]
    roots = small.fetch_packages(cache, dict.fromkeys(names), PACKAGES)
    seconds["download and extract"] = time.perf_counter() - start

    start = time.perf_counter()
    with multiprocessing.Pool(args.jobs) as pool:
        _POOL = pool
        docs = read_all(roots)
    _POOL = None
    heldout = {s.name for s in SOURCES if s.heldout}
    docs, duplicates = deduplicate(docs, heldout)
    sizes = Counter()
    for doc in docs:
        if doc.source not in heldout:
            sizes[doc.source] += len(doc.text.encode("utf-8"))
    docs, capped = apply_caps(docs, source_caps(dict(sizes), MAX_SHARE))
    splits = split_documents(docs, heldout)
    seconds["read and clean"] = time.perf_counter() - start

    start = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = {split: write_split(args.out_dir, split, split_docs, args.shard_mb * 10**6)
             for split, split_docs in splits.items()}
    seconds["write"] = time.perf_counter() - start
    tokens = None
    if not args.no_count:
        start = time.perf_counter()
        tokens = {split: small.count_tokens(split_docs) for split, split_docs in splits.items()}
        seconds["count tokens"] = time.perf_counter() - start
    versions = {name: small.package_version(root) for name, root in roots.items()}
    text = provenance(splits, tokens, versions, files, {"duplicates": duplicates, "cap": capped}, seconds)
    (args.out_dir / "PROVENANCE.md").write_text(text, encoding="utf-8")
    for split, split_docs in splits.items():
        size = sum(len(d.text.encode()) for d in split_docs) / 1e6
        count = f", {sum(tokens[split]):,} tokens" if tokens else ""
        print(f"{split}: {len(split_docs):,} documents, {size:.2f} MB of text{count}, {len(files[split])} file(s)")
        for written in files[split]:
            print(f"  {written.path}: {written.file_bytes / 2**20:.1f} MiB, sha256 {written.file_sha256}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
