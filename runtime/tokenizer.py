"""The engine directory's tokenizer (tokenizer.json) and chat template (tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as HFTokenizer

from kiln.chat_template import ChatTemplate
from kiln.errors import InvalidParamError
from kiln.manifest import EngineLoadError
from kiln.runtime.detokenizer import ChatMessage

_LONG_DECODE = 512  # ids; a decode this long releases the GIL while it runs


def _read_tokenizer(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed JSON
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EngineLoadError(f"engine file {path.name} is not a valid tokenizer ({reason})") from None


def _read_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json: an object whose special tokens are strings (or {"content": ...}) and whose
    chat_template is a string or a list of {"name", "template"}; {} when the engine has none."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineLoadError(f"engine file {path.name} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise EngineLoadError(f"engine file {path.name} must hold a JSON object")
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if not (value is None or isinstance(value, str) or isinstance(value, dict) and
                isinstance(value.get("content"), str)):
            raise EngineLoadError(f"engine file {path.name}: {key} must be a token string, got {value!r}")
    template = config.get("chat_template")
    if not (template is None or isinstance(template, str) or isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template)):
        raise EngineLoadError(f"engine file {path.name}: chat_template must be a string or a list of "
                              '{"name", "template"} objects')
    return config


class Tokenizer:
    def __init__(self, engine_dir: Path, chat_template: str | None = None) -> None:
        """chat_template: a Jinja template replacing the one in tokenizer_config.json (checked here)."""
        engine_dir = Path(engine_dir)
        self._tok = _read_tokenizer(engine_dir / "tokenizer.json")
        self.config = _read_config(engine_dir / "tokenizer_config.json")
        override = {} if chat_template is None else {"chat_template": chat_template}
        self._chat = ChatTemplate({**self.config, **override})
        self.bos_token, self.eos_token = self._chat.bos_token, self._chat.eos_token
        self.chat_template: str | None = self._chat.template
        if chat_template is not None:
            try:  # a broken template fails at load, in one sentence, not on every chat request
                self._chat.compile()
            except TemplateError as exc:
                raise InvalidParamError(f"the chat template is not valid Jinja: {exc}", "chat_template") from exc

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what structured output's llguidance tokenizer is built from)."""
        return str(self._tok.to_str())

    # The *_batch calls release the GIL while the Rust code runs (encode and decode hold it): tokenizing a long
    # prompt on the server's worker pool must not stop the event loop and the engine thread for its duration
    # (~3 us per character). Encoding one text either way costs the same; a short decode (the incremental
    # detokenizer's, every token) stays on the cheaper call.

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < _LONG_DECODE:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def tool_family(self) -> str | None:
        """Whose tool-call syntax the chat template writes, when it takes tools (ChatTemplate.tool_family)."""
        return self._chat.tool_family

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            raise InvalidParamError("this engine's tokenizer_config.json has no chat_template; pass a plain prompt",
                                    "messages")
        try:
            return self._chat.render(messages, add_generation_prompt, tools)
        except TemplateError as exc:
            raise InvalidParamError(f"chat template rejected the messages: {exc}", "messages") from exc
