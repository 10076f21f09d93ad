"""``python -m kiln.corpus --install`` fetches the corpus's Debian packages into the cache (``make install``
runs it); without --install, the documents and words of each split and domain."""

from __future__ import annotations

import argparse
import re

from . import DOMAINS, SPLITS, documents, install
from .debian import INSTALL_HINT, CorpusNotFound


def _word_count(text: str) -> int:
    return len(re.findall(r"\S+", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="fetch the corpus sources into the cache")
    args = parser.parse_args()
    if args.install:
        for root in install():
            print(root)
        return
    try:
        for split in SPLITS:
            for domain in DOMAINS[:3]:  # chat is made from the other three
                docs = [d for d in documents() if d.split == split and d.domain == domain]
                print(split, domain, len(docs), "documents", sum(_word_count(d.text) for d in docs), "words")
    except CorpusNotFound as exc:
        raise SystemExit(f"{exc}") from None
    print(INSTALL_HINT)


main()
