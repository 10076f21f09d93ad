"""Token windows of one domain's split of the corpus (kiln.corpus), the chat domain rendered with the
model's chat template (chat_mix.py)."""

from __future__ import annotations

from collections.abc import Callable

from kiln.chat_template import ChatTemplate
from kiln.errors import InvalidParamError

from . import DOMAINS, SPLITS, DomainWindows, cut_windows, split_passages
from .chat_mix import conversations


def domain_windows(domain: str, split: str, encode: Callable[[str], list[int]], window: int, count: int,
                   chat_template: ChatTemplate | None = None) -> DomainWindows:
    """Token windows of one domain's split; chat needs the model's ChatTemplate (kiln.chat_template)."""
    if split not in SPLITS:
        raise InvalidParamError(f"unknown corpus split {split!r}; choose one of {SPLITS}", "split")
    if domain not in DOMAINS:
        raise InvalidParamError(f"unknown corpus domain {domain!r}; choose one of {DOMAINS}", "domain")
    if domain == "chat":
        if chat_template is None or chat_template.template is None:
            raise InvalidParamError("the chat domain needs the model's chat template, and this tokenizer has none",
                                    "domain")
        texts = ((c.document, chat_template.render(c.messages, add_generation_prompt=False))
                 for c in conversations(split))
        return cut_windows(domain, texts, encode, window, count, separator="")  # a rendered turn ends its line
    texts = ((p.document.name, p.text) for p in split_passages(domain, split))
    return cut_windows(domain, texts, encode, window, count)
