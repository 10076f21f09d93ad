"""Reasoning models' thinking, split out of a chat answer: the text inside <think>...</think> goes to the message's
`reasoning_content` (vLLM's and DeepSeek's field; streamed as `delta.reasoning_content`), the rest to `content`
(and from there to the tool-call parser), as Qwen3, QwQ and DeepSeek-R1 write it.

A model thinks when its output starts with <think> (Qwen3), or when the prompt already opened the block: a chat
template that ends the generation prompt with "<think>\\n" (DeepSeek-R1, Qwen3's thinking templates) leaves the
output starting inside it, with only the closing tag to come. An output that opened the block and never closed
it (cut short by max_tokens) is all reasoning. Text before any <think> is content: a model that does not think
is unaffected.

The server turns it on per model: `kiln serve --reasoning-parser auto` (the default) when the tokenizer has both
tags as tokens of their own (they were added for thinking; a vocabulary without them spells "<think>" in several
pieces), `qwen3` always, `none` never. A request with an output constraint (a JSON schema, a regex, a forced tool
call) on a reasoning model keeps its thinking: the grammar lets the <think> block through as free text and
constrains what follows </think> (constrain_after_thinking). That needs the tags as tokens of their own; a model
served with `qwen3` whose vocabulary spells them in pieces gets a 400 for a constraint instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InvalidParamError
from kiln.runtime.params import SamplingParams

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("auto", "qwen3", "none")


def reasoning_enabled(choice: str, llm: Any) -> bool:
    """Whether the server splits reasoning for this model (choice: one of REASONING_PARSERS)."""
    if choice not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {choice!r}")
    if choice != "auto":
        return choice == "qwen3"
    return think_tags_are_tokens(llm)


def think_tags_are_tokens(llm: Any) -> bool:
    """<think> and </think> are one token each (a reasoning model's vocabulary)."""
    return all(len(llm.tokenize(tag, False)) == 1 for tag in (THINK_OPEN, THINK_CLOSE))


def constrain_after_thinking(params: SamplingParams, opened: bool, tags_are_tokens: bool) -> SamplingParams:
    """A reasoning model's request with its output constraint moved past the <think> block (`opened`: the prompt
    opened it). InvalidParamError naming the constraint's field when the tags are no tokens to find the end by."""
    spec = params.structured
    if spec is None:
        return params
    if not tags_are_tokens:
        raise InvalidParamError(f"{spec.param}: this model's reasoning cannot be followed by an output constraint: "
                                "its tokenizer spells <think> and </think> in pieces (serve it with "
                                "--reasoning-parser none to constrain the whole output)", spec.param)
    return dataclasses.replace(params, structured=spec.after_thinking(opened))


def opens_thinking(prompt: str) -> bool:
    """The prompt ends inside a <think> block its template opened (the output starts as reasoning)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass
class _Split:
    """One choice's stream: where it is (deciding, reasoning, content) and the text held back as a tag's start."""

    phase: str
    held: str = ""
    reasoning_started: bool = False
    content_started: bool = False
    strip_content: bool = False  # content after </think>: its leading blank lines belong to neither

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) this much more text adds; `final`: nothing more comes (release what is held)."""
        self.held += text
        reasoning = content = ""
        if self.phase == "deciding":
            start = self.held.lstrip()
            if start.startswith(THINK_OPEN):
                self.held, self.phase = start[len(THINK_OPEN):], "reasoning"
            elif THINK_OPEN.startswith(start) and not final:
                return "", ""  # blank so far, or a <think> still arriving
            else:
                self.phase = "content"
        if self.phase == "reasoning":
            if THINK_CLOSE in self.held:
                reasoning, self.held = self.held.split(THINK_CLOSE, 1)
                self.phase, self.strip_content = "content", True
            else:
                keep = 0 if final else _tag_prefix_at_end(self.held, THINK_CLOSE)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            if not self.reasoning_started:
                reasoning = reasoning.lstrip()
                self.reasoning_started = bool(reasoning)
        if self.phase == "content":
            content, self.held = self.held, ""
            if self.strip_content and not self.content_started:
                content = content.lstrip()
            self.content_started = self.content_started or bool(content)
        return reasoning, content


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of text that could be the start of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningSplitter:
    """Splits one chat request's choices: whole answers (split) or stream deltas (delta, per choice index), and
    counts their reasoning tokens (usage's reasoning_tokens)."""

    prompt_opens: bool  # opens_thinking(the rendered prompt)
    decode: Callable[[list[int]], str]  # token ids to text, special tokens kept (the tags may be special)
    streams: dict[int, _Split] = field(default_factory=dict)
    stream_tokens: dict[int, list[int]] = field(default_factory=dict)  # each streamed choice's tokens so far

    def reasoning_tokens(self, token_ids: list[int], thought: bool) -> int:
        """How many of an answer's tokens are its thinking: up to the one that completes </think>, or all of them
        when the block never closed; 0 when it did not think. Exact: the shortest prefix whose text holds the
        closing tag (a binary search over decodes, log2(n) of them)."""
        if not thought:
            return 0
        if THINK_CLOSE not in self.decode(token_ids):
            return len(token_ids)
        low, high = 1, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if THINK_CLOSE in self.decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low

    def streamed_reasoning_tokens(self) -> int:
        """The reasoning tokens of every streamed choice (call once they are finished)."""
        return sum(self.reasoning_tokens(ids, self.streams[i].phase == "reasoning" or self.streams[i].strip_content)
                   for i, ids in self.stream_tokens.items() if i in self.streams)

    def _start(self) -> _Split:
        return _Split("reasoning" if self.prompt_opens else "deciding")

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the model did not think, content) of a finished answer."""
        state = self._start()
        reasoning, content = state.feed(text, final=True)
        thought = state.phase == "reasoning" or state.strip_content
        return (reasoning if thought else None), content

    def delta(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of this much new text of choice `index`; `final` at its last delta."""
        state = self.streams.setdefault(index, self._start())
        return state.feed(text, final)
