"""Chat templates that take tools: the three families' syntaxes (Hermes/Qwen <tool_call>, Llama 3.1 JSON with the
ipython role, Mistral [TOOL_CALLS] with 9-character ids) written as templates (tests/unit/templates/) into tiny
tokenizers. Each is detected, gets the request's tools and the history's calls and results as Hugging Face's
renderer would give them (checked against transformers' apply_chat_template), and the model's answer in that
family's syntax comes back as OpenAI tool_calls, whole and streamed; a template without tools keeps the Hermes
system prompt."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import TINY_CHAT_TEMPLATE, write_tiny_tokenizer  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.app import _render, build_app  # noqa: E402
from kiln.runtime.server.protocol import ChatCompletionRequest  # noqa: E402
from kiln.runtime.tokenizer import Tokenizer  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"
FAMILY_TEMPLATES = {"hermes": "hermes_qwen.jinja", "llama3": "llama3_json.jinja", "mistral": "mistral.jinja"}
FAMILY_TOKENS = {"hermes": ["<tool_call>", "</tool_call>"], "llama3": ["<|python_tag|>", "<|eot_id|>"],
                 "mistral": ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_0123456789abcdef", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "21 C"},
           {"role": "assistant", "content": "21 C in Rome."},
           {"role": "user", "content": "And Oslo?"}]
ANSWERS = {"hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
           "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
           "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}


def tokenizer_dir(tmp_path: Path, family: str | None) -> Path:
    """A tiny byte-level tokenizer with the family's chat template and its tool tokens (special for Mistral and
    Llama, plain text tokens for Hermes, as those models ship them); family None: the ChatML template, no tools."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    out = tmp_path / (family or "plain")
    out.mkdir()
    write_tiny_tokenizer(out)
    if family is not None:
        hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
        hf.add_tokens([AddedToken(t, special=family != "hermes", normalized=False) for t in FAMILY_TOKENS[family]])
        hf.save(str(out / "tokenizer.json"))
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = (TEMPLATES / FAMILY_TEMPLATES[family]).read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


class TemplateLLM(FakeAsyncLLM):
    """The fake engine with a real tokenizer's chat template (the server renders through it)."""

    def __init__(self, tokenizer: Tokenizer, script: str):
        super().__init__(script=script)
        self.max_seq_len = 4096
        self.tokenizer = tokenizer
        self.tool_family = tokenizer.tool_family

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER], **fields})


@pytest.mark.parametrize("family", [*FAMILY_TEMPLATES, None])
def test_the_family_is_read_from_the_template(tmp_path, family):
    assert Tokenizer(tokenizer_dir(tmp_path, family)).tool_family == family


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_tools_and_history_render_as_transformers_renders_them(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    where = tokenizer_dir(tmp_path, family)
    tokenizer = Tokenizer(where)
    body = _request()
    prompt = _render(TemplateLLM(tokenizer, ""), body.messages, True, body.tool_mode())
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(where / "tokenizer.json"),
                                                     chat_template=tokenizer.chat_template,
                                                     bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    messages = json.loads(json.dumps(HISTORY))
    for m in messages:  # Hugging Face's templates take a call's arguments as an object
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            if family == "mistral":
                call["id"] = _mistral_id(prompt)
        if family == "mistral" and m["role"] == "tool":
            m["tool_call_id"] = _mistral_id(prompt)
    expected = reference.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert prompt == expected
    assert '"name": "get_weather"' in prompt and "Be brief." in prompt and "You are a function calling" not in prompt


def _mistral_id(prompt: str) -> str:
    ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', prompt)
    assert len(ids) == 2 and ids[0] == ids[1] and re.fullmatch(r"[A-Za-z0-9]{9}", ids[0]), ids
    return ids[0]


def test_a_template_without_tools_gets_the_hermes_prompt(tmp_path):
    tokenizer = Tokenizer(tokenizer_dir(tmp_path, None))
    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE
    body = _request()
    prompt = _render(TemplateLLM(tokenizer, ""), body.messages, True, body.tool_mode())
    assert "You are a function calling AI model" in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_the_familys_answer_comes_back_as_tool_calls(tmp_path, family):
    llm = TemplateLLM(Tokenizer(tokenizer_dir(tmp_path, family)), ANSWERS[family])
    with TestClient(build_app(lambda: llm)) as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        choice = oai.chat.completions.create(model="fake-model", messages=HISTORY, tools=[WEATHER]).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})]
        assert choice.message.content == ("Checking." if family == "hermes" else None)
        prompt, params = llm.requests[-1]
        assert prompt.count('"get_weather"') >= 2  # the tools, and the call in the history
        assert params.skip_special_tokens is (family != "mistral")  # [TOOL_CALLS] is special: kept in the text
        chunks = list(oai.chat.completions.create(model="fake-model", messages=HISTORY, tools=[WEATHER],
                                                  stream=True))
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"})]
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks).strip() == (
            "Checking." if family == "hermes" else "")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
