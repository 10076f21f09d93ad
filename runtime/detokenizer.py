"""Incremental detokenization and stop strings.

Byte-level BPE (and SentencePiece byte fallback) can split one character over several
tokens; decoding such a prefix yields U+FFFD. The detokenizer decodes a short window of
recent tokens and emits only the text that has become stable, never a partial character.
Stop strings are searched in the produced text; while a sequence runs, the last
len(longest stop) - 1 characters are held back so a stop string is never streamed before
it is recognised. Only the window of recent ids and the text not yet taken are kept, so each
token costs the same however long the output has grown (a run of tokens that add no text, such
as skipped special tokens, does not widen the window either).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from kiln.runtime.outputs import Logprob, RequestOutput


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


ChatMessage = dict[str, Any]  # {"role": ..., "content": ...} (+ tool_calls, tool_call_id with native tools)


def max_prompt_chars(tokenizer: TextTokenizer, vocab_size: int, max_seq_len: int) -> int:
    """The most characters a prompt of max_seq_len tokens can have: each token covers at most as many
    characters as its vocabulary string is long (byte-level BPE spells a byte as one character; byte
    fallback and special tokens spell more), so a longer text cannot fit and is refused untokenized."""
    longest = max((len(tokenizer.id_to_token(t) or "") for t in range(vocab_size)), default=1)
    return max_seq_len * max(longest, 1)


class TextTokenizer(Decoder, Protocol):
    """What the engine and its front ends need of a tokenizer (tokenizer.Tokenizer; a stand-in in tests)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...

    @property
    def tool_family(self) -> str | None: ...


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
        self.pending = ""  # stable text not yet taken (the held-back tail and what came since)
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
            del self.ids[:self.read_offset]  # the window moves on: keep only what the next decode reads
            self.prefix_offset, self.read_offset = 0, len(self.ids)
            self.pending += delta
            return delta
        if full == prefix:  # tokens that add no text (skipped special tokens) never widen the window
            del self.ids[self.read_offset:]
        return ""

    def find_stop(self, num_new_chars: int) -> str | None:
        """A stop string that ends within the last num_new_chars characters; drops the text from it on.

        Such a string starts at most `hold` characters before the new ones, and take() always
        leaves those pending, so it is never cut out of text already taken.
        """
        if not self.stop or not num_new_chars:
            return None
        start = max(0, len(self.pending) - num_new_chars - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.pending = self.pending[:i]
        return s

    def take(self, finished: bool) -> str:
        """The text a stream may show now that it has not shown yet (holding back a possible
        stop-string prefix until the sequence finishes)."""
        keep = 0 if finished else self.hold
        n = max(0, len(self.pending) - keep)
        text, self.pending = self.pending[:n], self.pending[n:]
        return text


def with_token_text(tokenizer: Decoder, output: RequestOutput) -> RequestOutput:
    """Fill in decoded_token of the output's logprobs (the engine leaves them None, so its
    thread decodes nothing a caller may not read)."""
    if all(o.logprobs is None for o in output.outputs):
        return output
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return texts[token_id]

    outputs = [
        o if o.logprobs is None else dataclasses.replace(o, logprobs=[
            {t: Logprob(lp.logprob, lp.rank, text(t)) for t, lp in step.items()} for step in o.logprobs
        ])
        for o in output.outputs
    ]
    return dataclasses.replace(output, outputs=outputs)
