"""The mixed-domain calibration and evaluation corpus, assembled from Debian packages.

Domains (what a chat model is asked), each from text whose licence allows it:
  prose      Jane Austen's novels (r-cran-janeaustenr) and Bierce's *The Devil's Dictionary*
             (dict-devil), both public domain;
  technical  Debian Policy, the FHS, the Debian FAQ (debian-policy, debian-faq) and the licence
             texts of base-files (/usr/share/common-licenses);
  code       the Python 3.13 standard library (libpython3.13-stdlib, PSF-2.0);
  chat       conversations made from the three above with the model's own chat template
             (chat_mix.py).
Every document belongs to exactly one split, fixed here (``split_of``): calibration (what
``kiln calibrate`` fits on), validation (for choosing methods and hyperparameters) and
evaluation (what ``kiln eval`` reports; never used to choose anything). Chat conversations
inherit the split of the document they are made from, so the splits stay disjoint.

A split's text for one domain is a stream of passages (a few paragraphs, ~2-4k characters) of
its documents in a fixed pseudo-random order (sha256 of the passage's name), so the first
windows already cover many documents; token windows are cut from the start of that stream.
Same package versions and tokenizer -> the same windows (``windows``). ``manifest`` names the
sources (package, version, sha256 of the .deb, licence), the documents the windows came from and
a digest of the token ids; every calibration artifact stores it.

``make install`` fetches the packages (``python -m kiln.corpus --install``) into
``~/.cache/kiln/corpus`` (or ``$KILN_CACHE_DIR/corpus``) without touching the system's apt setup.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kiln.errors import InvalidParamError

from .debian import CorpusNotFound as CorpusNotFound  # the error every reader of the corpus may raise
from .debian import DebianSource, fetch
from .rdata import BOOKS, DATA_SUBDIR, read_book

DOMAINS = ("prose", "technical", "code", "chat")
SPLITS = ("calibration", "validation", "evaluation")
PASSAGE_CHARS = 2000  # a passage is whole paragraphs, at least this long (the last one of a document may be shorter)
SHARED_PARAGRAPH_CHARS = 100  # held-out splits drop paragraphs this long or longer that calibration also has

AUSTEN = DebianSource("r-cran-janeaustenr", str(DATA_SUBDIR / "Rdata.rdb"), "public domain (Project Gutenberg text)")
DEVIL = DebianSource("dict-devil", "usr/share/dictd/devil.dict.dz", "public domain (copyright expired)")
POLICY = DebianSource("debian-policy", "usr/share/doc/debian-policy/policy.txt.gz",
                      "GPL-2+ (Debian Policy, Perl and menu policies); FHS licence, verbatim copies (FHS 3.0)")
FAQ = DebianSource("debian-faq", "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz",
                   "verbatim and modified copies permitted with the notice (Software in the Public Interest)")
LICENCES = DebianSource("base-files", "usr/share/common-licenses/GPL-3",
                        "verbatim copies permitted (each text's own notice)")
STDLIB = DebianSource("libpython3.13-stdlib", "usr/lib/python3.13/difflib.py", "PSF-2.0")
SOURCES = (AUSTEN, DEVIL, POLICY, FAQ, LICENCES, STDLIB)

# Old names kept for `kiln eval --text`-style single-book use and the golden tests.
CALIBRATION_BOOK = "sensesensibility"
EVALUATION_BOOK = "persuasion"
_DATA_SUBDIR = DATA_SUBDIR


@dataclass(frozen=True)
class Document:
    domain: str  # prose | technical | code (chat is made from these)
    name: str  # "<package>:<what>", unique
    source: DebianSource
    split: str
    title: str  # how a chat turn refers to it
    load: Callable[[], str]

    @property
    def text(self) -> str:
        return self.load()


def _data_dir() -> Path:
    return AUSTEN.root() / DATA_SUBDIR


def load_book(name: str) -> str:
    """One Austen novel as plain text: one line per paragraph, paragraphs separated by a blank line."""
    if name not in BOOKS:
        raise ValueError(f"unknown book {name!r}; the corpus has {BOOKS}")
    return _book(_data_dir(), name)


@cache
def _book(data: Path, name: str) -> str:
    return read_book(data, name)


def calibration_text() -> str:
    return load_book(CALIBRATION_BOOK)


def evaluation_text() -> str:
    return load_book(EVALUATION_BOOK)


@cache
def _read(path: Path) -> str:
    """A source file's text (gunzipped if .gz), read once per process: the splits re-read every document."""
    raw = path.read_bytes()
    return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")


def _gz_text(source: DebianSource, path: str) -> Callable[[], str]:
    return lambda: _read(source.root() / path)


def _plain_text(source: DebianSource, path: str) -> Callable[[], str]:
    return lambda: _read(source.root() / path)


def devils_dictionary() -> str:
    """The dictionary's entries as text, from its preface on (dictd's own header entries dropped)."""
    raw = gzip.decompress((DEVIL.root() / DEVIL.probe).read_bytes()).decode("utf-8", errors="replace")
    start = raw.find("PREFACE")
    return raw[start if start >= 0 else 0:]


# The prose and technical documents and their splits: evaluation texts are whole works never
# calibrated on (Persuasion, the Debian FAQ); validation, other whole works. (Policy's upgrading
# checklist is left out: the Policy Manual already holds it.)
_PROSE = (("sensesensibility", "calibration"), ("prideprejudice", "calibration"), ("emma", "calibration"),
          ("mansfieldpark", "calibration"), ("northangerabbey", "validation"), ("persuasion", "evaluation"))
_POLICY_DOCS = (("policy.txt.gz", "calibration", "the Debian Policy Manual"),
                ("perl-policy.txt.gz", "calibration", "the Debian Perl Policy"),
                ("menu-policy.txt.gz", "calibration", "the Debian Menu sub-policy"),
                ("debconf_specification.txt.gz", "calibration", "the debconf specification"),
                ("copyright-format-1.0.txt.gz", "calibration", "the machine-readable debian/copyright format"),
                ("fhs/fhs-3.0.txt.gz", "validation", "the Filesystem Hierarchy Standard"))


_NOT_CODE = ("pydoc_data/",)  # the library reference as one big dict of strings: prose, not code


def _code_split(relpath: str) -> str:
    """A stdlib module's split from the sha256 of its path: 1 in 10 evaluation, 1 in 10 validation."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 10
    return "evaluation" if bucket == 0 else "validation" if bucket == 1 else "calibration"


def documents() -> list[Document]:
    """Every document of the corpus, in a fixed order (needs the sources installed)."""
    docs = [Document("prose", f"janeaustenr:{book}", AUSTEN, split, f"Jane Austen's novel {book!r}",
                     lambda b=book: load_book(b)) for book, split in _PROSE]
    docs.append(Document("prose", "dict-devil:devil", DEVIL, "calibration",
                         "Ambrose Bierce's The Devil's Dictionary", devils_dictionary))
    for path, split, title in _POLICY_DOCS:
        docs.append(Document("technical", f"debian-policy:{path}", POLICY, split, title,
                             _gz_text(POLICY, f"usr/share/doc/debian-policy/{path}")))
    docs.append(Document("technical", "debian-faq:debian-faq.en.txt", FAQ, "evaluation", "the Debian FAQ",
                         _gz_text(FAQ, FAQ.probe)))
    licences = LICENCES.root() / "usr/share/common-licenses"
    for path in sorted(licences.iterdir()):
        if path.is_file() and not path.is_symlink():  # GPL -> GPL-3 etc. are the same text
            rel = str(path.relative_to(LICENCES.root()))
            docs.append(Document("technical", f"base-files:{path.name}", LICENCES, "calibration",
                                 f"the {path.name} licence", _plain_text(LICENCES, rel)))
    stdlib = STDLIB.root() / "usr/lib/python3.13"
    for path in sorted(stdlib.rglob("*.py")):
        rel = str(path.relative_to(stdlib))
        if rel.startswith(_NOT_CODE):
            continue
        docs.append(Document("code", f"python3.13:{rel}", STDLIB, _code_split(rel), f"Python's {rel}",
                             _plain_text(STDLIB, str(path.relative_to(STDLIB.root())))))
    return docs


def split_of(name: str) -> str:
    return next(d.split for d in documents() if d.name == name)


@dataclass(frozen=True)
class Passage:
    document: Document
    index: int
    text: str

    @property
    def name(self) -> str:
        return f"{self.document.name}#{self.index}"


def _key(paragraph: str) -> str:
    return " ".join(paragraph.split())


def passages(doc: Document, min_chars: int = PASSAGE_CHARS, drop: frozenset[str] = frozenset()) -> list[Passage]:
    """The document cut at blank lines into runs of whole paragraphs of at least min_chars, leaving out
    the paragraphs in drop (by their whitespace-normalised text)."""
    out: list[Passage] = []
    current: list[str] = []
    size = 0
    for paragraph in doc.text.split("\n\n"):
        if not paragraph.strip() or (drop and _key(paragraph) in drop):
            continue
        current.append(paragraph)
        size += len(paragraph)
        if size >= min_chars:
            out.append(Passage(doc, len(out), "\n\n".join(current)))
            current, size = [], 0
    if current:
        out.append(Passage(doc, len(out), "\n\n".join(current)))
    return out


def _order(passage: Passage) -> str:
    return hashlib.sha256(passage.name.encode()).hexdigest()


def passage_stream(docs: list[Document], drop: frozenset[str] = frozenset()) -> list[Passage]:
    """All passages of docs in the corpus's fixed pseudo-random order."""
    return sorted((p for d in docs for p in passages(d, drop=drop)), key=_order)


def split_passages(domain: str, split: str) -> list[Passage]:
    """The passage stream of one domain's split. A held-out split leaves out every paragraph of 100+
    characters that the calibration split also has (stdlib modules share code, licences share
    clauses), so no held-out text was calibrated on."""
    docs = [d for d in documents() if d.domain == domain]
    drop = frozenset()
    if split != "calibration":
        drop = frozenset(k for d in docs if d.split == "calibration"
                         for p in d.text.split("\n\n") if len(k := _key(p)) >= SHARED_PARAGRAPH_CHARS)
    return passage_stream([d for d in docs if d.split == split], drop)


def user_documents(path: Path) -> list[Document]:
    """`--calibration-text FILE|DIR`: the file, or every file under DIR (sorted), as one "user" domain."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise InvalidParamError(f"--calibration-text {path} holds no files", "calibration_text")
    source = DebianSource("user", "", "supplied by the user")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InvalidParamError(f"--calibration-text file {f} is not UTF-8 text", "calibration_text") from None
        docs.append(Document("user", f"file:{f}", source, "calibration", f.name, lambda t=text: t))
    return docs


@dataclass(frozen=True)
class DomainWindows:
    domain: str
    windows: list[list[int]]
    documents: list[str]  # names of the documents the windows' text came from, in stream order


def cut_windows(domain: str, texts: Iterable[tuple[str, str]], encode: Callable[[str], list[int]],
                window: int, count: int, separator: str = "\n\n") -> DomainWindows:
    """The first `count` non-overlapping windows of `window` tokens of the (document name, text) stream,
    each text followed by separator; fewer when the stream runs out first."""
    ids: list[int] = []
    used: list[str] = []
    for name, text in texts:
        if len(ids) >= window * count:
            break
        ids += encode(text + separator)
        if name not in used:
            used.append(name)
    n = min(count, len(ids) // window)
    return DomainWindows(domain, [ids[i * window:(i + 1) * window] for i in range(n)], used)


def token_digest(windows: list[list[int]]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(b"".join(t.to_bytes(4, "little") for t in w))
    return h.hexdigest()


def manifest(split: str, window: int, per_domain: list[DomainWindows], sources: list[dict]) -> dict:
    """What a set of windows was made of: the sources (package, version, sha256, licence), and per
    domain the windows, tokens, documents used and a digest of the token ids."""
    return {"split": split, "window": window, "sources": sources,
            "domains": {d.domain: {"windows": len(d.windows), "tokens": sum(map(len, d.windows)),
                                   "token_sha256": token_digest(d.windows), "documents": d.documents}
                        for d in per_domain}}


def source_records(domains: tuple[str, ...] = DOMAINS) -> list[dict]:
    """The manifest's source list: the Debian packages the built-in domains read."""
    used = {AUSTEN, DEVIL} if "prose" in domains else set()
    if "technical" in domains:
        used |= {POLICY, FAQ, LICENCES}
    if "code" in domains:
        used.add(STDLIB)
    if "chat" in domains:
        used |= set(SOURCES)
    return [s.record() for s in SOURCES if s in used]


def install() -> list[Path]:
    """Fetch every source package into the cache (once); their roots."""
    return fetch(list(SOURCES))

