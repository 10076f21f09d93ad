"""Incremental detokenization and stop strings.

Byte-level BPE (and SentencePiece byte fallback) can split one character over several
tokens; decoding such a prefix yields U+FFFD. The detokenizer decodes a short window of
recent tokens and emits only the text that has become stable, never a partial character.
Stop strings are searched in the produced text; while a sequence runs, the last
len(longest stop) - 1 characters are held back so a stop string is never streamed before
it is recognised.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-6:])  # context so leading spaces decode right
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # all stable output text
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; returns the newly stable text (may be empty)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def find_stop(self, num_new_chars: int) -> str | None:
        """A stop string that ends within the last num_new_chars characters; truncates text before it."""
        if not self.stop or not num_new_chars:
            return None
        start = max(0, len(self.text) - num_new_chars - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """The text a stream may show now (holding back a possible stop-string prefix)."""
        if finished or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
