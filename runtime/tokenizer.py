"""The engine directory's tokenizer (tokenizer.json) and chat template (tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as HFTokenizer

from kiln.chat_template import ChatTemplate
from kiln.errors import InvalidParamError
from kiln.runtime.detokenizer import ChatMessage


class Tokenizer:
    def __init__(self, engine_dir: Path) -> None:
        engine_dir = Path(engine_dir)
        self._tok = HFTokenizer.from_file(str(engine_dir / "tokenizer.json"))
        config_path = engine_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._chat = ChatTemplate(self.config)
        self.bos_token, self.eos_token = self._chat.bos_token, self._chat.eos_token
        self.chat_template: str | None = self._chat.template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidParamError("this engine's tokenizer_config.json has no chat_template; pass a plain prompt",
                                    "messages")
        try:
            return self._chat.render(messages, add_generation_prompt)
        except TemplateError as exc:
            raise InvalidParamError(f"chat template rejected the messages: {exc}", "messages") from exc
