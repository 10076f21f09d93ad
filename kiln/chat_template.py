"""Rendering a Hugging Face chat template (jinja, sandboxed), shared by the runtime's tokenizer and
the build's templated chat corpus (corpus/chat_mix.py), so both see the same conversation text."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import Template, meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: str | dict[str, str] | None) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value


class ChatTemplate:
    """The chat template, BOS and EOS of a tokenizer_config.json; `template` is None when it has none."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.template: str | None = template
        self._compiled: Template | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as text; raises jinja2's TemplateError when the template rejects it.
        tools: OpenAI-shaped function tools, for a template that takes them (tool_family)."""
        return self.compile().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)

    @property
    def tool_family(self) -> str | None:
        """Whose tool-call syntax the template writes, when it takes `tools`: "mistral" ([TOOL_CALLS]),
        "hermes" (<tool_call> blocks: Hermes, Qwen) or "llama3" (a JSON {"name", "parameters"} object, the
        ipython role); None for a template that takes no tools (SmolLM2's)."""
        if self.template is None or "tools" not in meta.find_undeclared_variables(
                self.compile().environment.parse(self.template)):
            return None
        if "[TOOL_CALLS]" in self.template:
            return "mistral"
        if "<tool_call>" in self.template:
            return "hermes"
        return "llama3"

    def compile(self) -> Template:
        """The compiled template (once); raises TemplateError when there is none or it is not valid Jinja."""
        if self.template is None:
            raise TemplateError("no chat_template")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled = env.from_string(self.template)
        return self._compiled
