"""Jane Austen's novels from Debian's ``r-cran-janeaustenr``, read without R.

The package keeps one R character vector of lines per book in an R lazy-load database
(data/Rdata.rdb + .rdx); this is a minimal R unserializer (XDR format 2/3: character, logical,
integer, double vectors, lists, attributes) and the reflow of the e-text's hard-wrapped lines.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
DATA_SUBDIR = Path("usr/lib/R/site-library/janeaustenr/data")


def read_book(data: Path, name: str) -> str:
    """One novel as plain text: one line per paragraph, paragraphs separated by a blank line."""
    if name not in BOOKS:
        raise ValueError(f"unknown book {name!r}; the corpus has {BOOKS}")
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
