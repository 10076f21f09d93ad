"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of strings, or a
context-free grammar (Lark, or llama.cpp's GBNF). Frozen and checked when made: a schema with an unsupported
keyword, a regex that does not compile or a grammar with an error fails here, naming the field, before any
tokenizer or engine is involved. The text is kept as given (a schema's property order is the order the output
writes them), so equal specs hash equal and share one compiled grammar per engine (runtime/structured/grammar.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from kiln.errors import InvalidParamError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
THINKING = ("", "optional", "opened")
# A reasoning model's <think> block ahead of the constrained answer: the tags as the tokens they are in a reasoning
# model's vocabulary (llguidance's <token> syntax: the tag's text spelled in pieces does not match it), the thought
# free text, then the blank lines models write after </think>. @answer is the answer's own grammar.
_THOUGHT = "THOUGHT: /(.|\\n)*/\nGAP: /[ \\n]*/"
_THINKING_START = {"optional": "start: (<think> THOUGHT </think> GAP)? @answer",
                   "opened": "start: THOUGHT </think> GAP @answer"}

# JSON the way json.dumps writes it, with no free whitespace: a model cannot pad the output with newlines until
# max_tokens (small models do), and the separators are the ones models have seen most.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """kind: one of KINDS; text: the JSON schema (JSON text), the regex, the choices (a JSON list of strings) or
    the grammar (Lark or GBNF); empty for json_object. Make one with the class methods. param: the request field
    an error names (a server passes e.g. "response_format"); not part of equality. thinking: where the constraint
    starts for a reasoning model (see after_thinking): "" at the first token, "optional" after a <think> block
    the output may open, "opened" after the </think> that closes the block the prompt opened."""

    kind: str
    text: str = ""
    param: str = field(default="structured", compare=False)
    thinking: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParamError(f"{self.param} kind must be one of {list(KINDS)}, got {self.kind!r}", self.param)
        if not isinstance(self.text, str):
            raise InvalidParamError(f"{self.param} {self.kind} must be given as text, got {type(self.text).__name__}",
                                    self.param)
        if self.thinking not in THINKING:
            raise InvalidParamError(f"{self.param} thinking must be one of {list(THINKING)}, got {self.thinking!r}",
                                    self.param)
        error = llguidance.LLMatcher.validate_grammar(self.llguidance_grammar())
        if error:
            raise InvalidParamError(f"{self.param}: the {self.kind.replace('_', ' ')} cannot be used: "
                                    f"{_first_lines(error)}", self.param)

    # -- constructors ---------------------------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool, param: str = "structured") -> StructuredOutput:
        """A JSON schema (a dict, JSON text, or true for any JSON value)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidParamError(f"{param}: the JSON schema is not valid JSON ({exc})", param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidParamError(f"{param}: a JSON schema must be an object (or true), got "
                                    f"{type(schema).__name__}", param)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def json_object(cls, param: str = "structured") -> StructuredOutput:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "structured") -> StructuredOutput:
        """Text matching the whole regex (Rust regex syntax: no look-around or back-references)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidParamError(f"{param}: the regex must be a non-empty string, got {pattern!r}", param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str = "structured") -> StructuredOutput:
        """Exactly one of the strings."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidParamError(f"{param}: choices must be a non-empty list of non-empty strings, got "
                                    f"{options!r}", param)
        return cls("choice", json.dumps(list(options), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, grammar: str, param: str = "structured") -> StructuredOutput:
        """A context-free grammar in Lark syntax (llguidance's dialect) or llama.cpp's GBNF."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidParamError(f"{param}: the grammar must be a non-empty string", param)
        return cls("grammar", grammar, param)

    # -- reading ----------------------------------------------------------------------------------------------

    @property
    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema the output validates against (None for regex, choice and grammar)."""
        if self.kind == "json_schema":
            value: dict[str, Any] | bool = json.loads(self.text)
            return value
        return {"type": "object"} if self.kind == "json_object" else None

    def after_thinking(self, opened: bool) -> StructuredOutput:
        """The same constraint applied after a reasoning model's <think>...</think> block: the block is free text
        (`opened`: the prompt already opened it, so the output starts inside it; else the output may open one or
        answer at once). The model's vocabulary must hold <think> and </think> as tokens."""
        return dataclasses.replace(self, thinking="opened" if opened else "optional")

    def llguidance_grammar(self) -> str:
        """The spec as an llguidance grammar (not yet checked: validate_grammar or a matcher does that)."""
        answer = self._answer_grammar()
        if not self.thinking:
            return answer
        # a JSON schema's and a regex's come as llguidance's JSON grammar list; a choice's and a grammar's as Lark
        grammars = json.loads(answer)["grammars"] if self.kind in ("json_schema", "json_object", "regex") else [
            {"lark_grammar": answer}]
        grammars[0]["name"] = "answer"  # the start grammar
        thinking = {"name": "thinking", "lark_grammar": f"{_THINKING_START[self.thinking]}\n{_THOUGHT}"}
        return json.dumps({"grammars": [thinking, *grammars]})

    def _answer_grammar(self) -> str:
        if self.kind in ("json_schema", "json_object"):
            schema = self.text if self.kind == "json_schema" else '{"type": "object"}'
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.text))
        if self.kind == "choice":
            return str(llguidance.grammar_from("choice", self.text))
        try:
            return str(llguidance.grammar_from("grammar", self.text))
        except ValueError as exc:  # GBNF that does not convert to Lark
            raise InvalidParamError(f"{self.param}: the grammar cannot be used: {_first_lines(str(exc))}",
                                    self.param) from None


def _first_lines(message: str, limit: int = 4) -> str:
    """llguidance's errors carry the offending source under a caret: keep the first few lines, in one."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit])
