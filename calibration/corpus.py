"""Calibration and evaluation text: Jane Austen's six novels (public domain), from Debian.

Source: Debian package ``r-cran-janeaustenr`` (main, MIT-packaged; the text is Project
Gutenberg's public-domain edition of the novels, one R character vector of lines per book).
It is fetched with ``apt-get download`` into a private cache and unpacked with ``dpkg -x``
(the system's apt configuration is not touched, R is not needed): see ``install()``, run by
``make install`` as ``python -m kiln.calibration.corpus --install``.

Fixed splits (disjoint books, so evaluation text is never seen by calibration):
  calibration: Sense and Sensibility      evaluation: Persuasion
The R lazy-load database (data/Rdata.rdb + .rdx) is read here with a minimal R
unserializer (XDR format 2/3: character, logical, integer, double vectors, lists, attributes).
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

DEBIAN_PACKAGE = "r-cran-janeaustenr"
DEBIAN_SUITE = "deb http://deb.debian.org/debian trixie main"
BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
CALIBRATION_BOOK = "sensesensibility"
EVALUATION_BOOK = "persuasion"
INSTALL_HINT = "run `make install` or `python -m kiln.calibration.corpus --install`"
_DATA_SUBDIR = Path("usr/lib/R/site-library/janeaustenr/data")


class CorpusNotFound(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / "corpus" / DEBIAN_PACKAGE


def _data_dir() -> Path:
    for root in (cache_dir(), Path("/")):
        if (root / _DATA_SUBDIR / "Rdata.rdb").is_file():
            return root / _DATA_SUBDIR
    raise CorpusNotFound(
        f"the calibration corpus (Debian package {DEBIAN_PACKAGE}) is not installed in {cache_dir()}; {INSTALL_HINT}"
    )


def load_book(name: str) -> str:
    """One novel as plain text: one line per paragraph, paragraphs separated by a blank line."""
    if name not in BOOKS:
        raise ValueError(f"unknown book {name!r}; the corpus has {BOOKS}")
    data = _data_dir()
    index_bytes = (data / "Rdata.rdx").read_bytes()
    gzipped = index_bytes[:2] == b"\x1f\x8b"
    index = _unserialize(gzip.decompress(index_bytes) if gzipped else zlib.decompress(index_bytes[4:]))
    variables = dict(zip(index.names, index, strict=True))["variables"]  # R keeps names as long as the list
    offset, length = dict(zip(variables.names, variables, strict=True))[name]
    with open(data / "Rdata.rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    lines = _unserialize(zlib.decompress(blob[4:]))  # 4-byte big-endian raw length, then zlib
    return _reflow(lines)


def _reflow(lines: list[str]) -> str:
    """Undo the e-text's hard wrapping: one line per paragraph, paragraphs separated by a blank line."""
    paragraphs, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"


def calibration_text() -> str:
    return load_book(CALIBRATION_BOOK)


def evaluation_text() -> str:
    return load_book(EVALUATION_BOOK)


class _Vector(list):
    names: list = []


def _unserialize(raw: bytes):
    """Minimal reader of R's XDR serialization: enough for character/integer vectors and lists."""
    if raw[:2] != b"X\n":
        raise ValueError("not an R XDR serialization stream")
    pos = 2
    version = struct.unpack_from(">i", raw, pos)[0]
    pos += 12
    if version == 3:
        n = struct.unpack_from(">i", raw, pos)[0]
        pos += 4 + n  # native encoding name
    refs: list = []

    def read_int():
        nonlocal pos
        v = struct.unpack_from(">i", raw, pos)[0]
        pos += 4
        return v

    def read_item():
        nonlocal pos
        flags = read_int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP
            return refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            sym = read_item()
            refs.append(sym)
            return sym
        if kind == 9:  # CHARSXP
            n = read_int()
            if n == -1:
                return None
            s = raw[pos:pos + n].decode("utf-8", errors="replace")
            pos += n
            return s
        if kind == 2:  # LISTSXP (pairlist): attributes
            out = {}
            while kind == 2:
                if has_attr:
                    read_item()
                tag = read_item() if has_tag else None
                out[tag] = read_item()
                flags = read_int()
                kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if kind != 254:
                raise ValueError(f"unexpected R pairlist terminator {kind}")
            return out
        if kind in (10, 13, 14, 16, 19):  # LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP
            n = read_int()
            if kind in (10, 13, 14):
                fmt = "d" if kind == 14 else "i"
                vec = _Vector(struct.unpack_from(f">{n}{fmt}", raw, pos))
                pos += struct.calcsize(fmt) * n
            else:
                vec = _Vector(read_item() for _ in range(n))
            if has_attr:
                attrs = read_item()
                vec.names = list(attrs.get("names") or [])
            return vec
        raise ValueError(f"unsupported R object type {kind}")

    return read_item()


def install(dest: Path | None = None) -> Path:
    """Download the Debian package into the cache with a private apt sources list; return the data dir."""
    dest = dest or cache_dir()
    if (dest / _DATA_SUBDIR / "Rdata.rdb").is_file():
        return dest / _DATA_SUBDIR
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise CorpusNotFound(f"apt-get and dpkg are needed to fetch the Debian package {DEBIAN_PACKAGE}")
    with tempfile.TemporaryDirectory(prefix="kiln-apt-") as tmp:
        d = Path(tmp)
        (d / "lists" / "partial").mkdir(parents=True)
        (d / "cache" / "archives" / "partial").mkdir(parents=True)
        (d / "sources.list").write_text(DEBIAN_SUITE + "\n")
        opts = [f"-oDir::Etc::SourceList={d / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null",
                f"-oDir::State::Lists={d / 'lists'}", f"-oDir::Cache={d / 'cache'}", "-qq"]
        if os.geteuid() == 0:
            opts.append("-oAPT::Sandbox::User=root")
        print(f"kiln: fetching the calibration corpus ({DEBIAN_PACKAGE}) from the Debian archive", file=sys.stderr)
        subprocess.run(["apt-get", *opts, "update"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", *opts, "download", DEBIAN_PACKAGE], check=True, cwd=d, stdout=subprocess.DEVNULL)
        deb = sorted(d.glob(f"{DEBIAN_PACKAGE}_*.deb"))[-1]
        staging = d / "x"
        subprocess.run(["dpkg", "-x", str(deb), str(staging)], check=True)
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, dest)
    return dest / _DATA_SUBDIR


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="fetch the corpus into the cache")
    args = parser.parse_args()
    if args.install:
        print(install())
    else:
        for book in BOOKS:
            print(book, len(load_book(book).split()), "words")
