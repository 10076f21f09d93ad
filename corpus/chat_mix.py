"""The chat domain: single-turn conversations made from the corpus's own documents, to be rendered
with the model's chat template, so calibration and evaluation see the template's tokens and the
shape of a chat (a user turn, then an answer) as a chat model is used.

Templates (one conversation per passage, the domains taken in turn):
  * the Debian FAQ: its question as the user turn, its answer as the assistant's;
  * prose and other technical text: "Continue this passage from <title>:" + the first paragraph,
    answered by the rest of the passage;
  * code: the first lines of a stdlib passage in a fenced block with "Continue this code from
    <title>.", answered by the rest in a fenced block.
A conversation has the split of the document it is made from (kiln.corpus keeps them disjoint).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest

from . import Passage, documents, split_passages

CHAT_CHARS = 1500  # a conversation's source text is cut to about this: a few of them fill a window
_FAQ_QUESTION = re.compile(r"^\d+\.\d+(\.\d+)*\.[ \xa0]", re.M)  # the text puts a no-break space there


@dataclass(frozen=True)
class Conversation:
    document: str  # the document's name
    messages: list[dict[str, str]]


def faq_pairs(text: str) -> list[tuple[str, str]]:
    """(question, answer) of each numbered FAQ section: the heading at column 0 (it may wrap), then the
    indented answer up to the next heading."""
    starts = [m.start() for m in _FAQ_QUESTION.finditer(text)]
    pairs = []
    for a, b in zip(starts, starts[1:] + [len(text)], strict=True):
        heading, _, body = text[a:b].partition("\n\n")
        question = " ".join(heading.split()).split(None, 1)[-1]  # str.split() splits at no-break spaces too
        answer = "\n".join(line[4:] if line.startswith("    ") else line for line in body.strip("\n").splitlines())
        if question and answer.strip():
            pairs.append((question, answer.strip()))
    return pairs


def _clip(paragraphs: list[str]) -> list[str]:
    out, size = [], 0
    for p in paragraphs:
        if out and size + len(p) > CHAT_CHARS:
            break
        out.append(p)
        size += len(p)
    return out


def _continuation(passage: Passage) -> Conversation | None:
    paragraphs = _clip([p for p in passage.text.split("\n\n") if p.strip()])
    if len(paragraphs) < 2:
        return None
    doc = passage.document
    first, rest = paragraphs[0], "\n\n".join(paragraphs[1:])
    if doc.domain == "code":
        user = f"Continue this code from {doc.title}.\n\n```python\n{first}\n```"
        answer = f"```python\n{rest}\n```"
    else:
        user = f"Continue this passage from {doc.title}:\n\n{first}"
        answer = rest
    return Conversation(doc.name, [{"role": "user", "content": user}, {"role": "assistant", "content": answer}])


def _from_domain(domain: str, split: str) -> Iterator[Conversation]:
    faq = [d for d in documents() if d.domain == domain and d.split == split and d.name.startswith("debian-faq:")]
    for doc in faq:
        for question, answer in faq_pairs(doc.text):
            clipped = "\n\n".join(_clip(answer.split("\n\n")))
            yield Conversation(doc.name, [{"role": "user", "content": question},
                                          {"role": "assistant", "content": clipped}])
    for passage in split_passages(domain, split):
        if passage.document not in faq:
            conversation = _continuation(passage)
            if conversation is not None:
                yield conversation


def conversations(split: str) -> Iterator[Conversation]:
    """Conversations from the split's documents, prose, technical and code in turn (a domain that runs
    out is skipped)."""
    streams = [_from_domain(domain, split) for domain in ("prose", "technical", "code")]
    for batch in zip_longest(*streams):
        yield from (c for c in batch if c is not None)
