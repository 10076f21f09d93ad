"""Tool calling's pure pieces: the model's own call syntax parsed (Hermes, Mistral, Llama 3), streamed deltas
that hold a call back from the content, the forced-call schemas, the tools' prompt, and request-field mapping."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.errors import InvalidParamError
from kiln.runtime.server.protocol import ChatCompletionRequest, ChatMessage
from kiln.runtime.server.tools import ToolResponses, render_messages
from kiln.runtime.tool_calls import parse_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                 **fields})


@pytest.mark.parametrize("text", [
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    'Let me check.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
])
def test_the_families_call_syntaxes_parse(text):
    content, calls = parse_calls(text, {"get_weather"})
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_llama3_json_and_text_that_is_no_call():
    content, calls = parse_calls('{"name": "get_time", "parameters": {}}', {"get_time"})
    assert content is None and calls[0]["function"]["arguments"] == "{}"
    for text in ('{"name": "rm_rf", "arguments": {}}', "Paris is sunny.", "<tool_call>not json</tool_call>"):
        assert parse_calls(text, {"get_time"}) == (text, [])


def test_parallel_hermes_calls_keep_their_order():
    text = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in ("get_time", "get_weather"))
    assert [c["function"]["name"] for c in parse_calls(text, {"get_time", "get_weather"})[1]] == [
        "get_time", "get_weather"]


def test_auto_streaming_sends_content_and_holds_back_the_call():
    tools = ToolResponses(request(tool_choice="auto").tool_mode())
    pieces = ["Sure", ", one moment. <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    deltas = [tools.delta(0, p, None) for p in pieces] + [tools.delta(0, "", "stop")]
    sent = "".join(d.get("content", "") for d, _ in deltas)
    assert sent == "Sure, one moment. " and "<" not in sent
    final, reason = deltas[-1]
    assert reason == "tool_calls" and final["tool_calls"][0]["function"]["name"] == "get_time"
    plain = ToolResponses(request(tool_choice="auto").tool_mode())
    assert plain.delta(0, "a < b", None)[0] == {"content": "a < b"}  # no marker's start at the end
    assert plain.delta(0, " <tool", None)[0] == {"content": " "} and plain.delta(0, "", "stop") == (
        {"content": "<tool"}, "stop")  # held as a possible marker, then text after all


def test_required_schema_accepts_calls_and_parses_them():
    mode = request(tool_choice="required", parallel_tool_calls=False).tool_mode()
    schema = mode.constraint().schema
    one = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)  # parallel_tool_calls false: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    content, calls = mode.parse(json.dumps(one))
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode().constraint().schema == TOOLS[0]["function"]["parameters"]
    assert named.sampling_params().structured == named.tool_mode().constraint()


def test_bad_tool_requests_name_the_field():
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    for fields, param in (({"tools": bad_schema}, "tools.0.function.parameters"),
                          ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name"),
                          ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice")):
        with pytest.raises(InvalidParamError) as err:
            request(**fields).sampling_params()
        assert err.value.param == param


def test_history_with_calls_and_tool_results_renders_for_any_template():
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]]
    rendered = render_messages(messages, request(tool_choice="auto").tool_mode())
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert rendered[3]["content"] == "<tool_response>\n21 C\n</tool_response>"
    assert render_messages(messages, None)[0] == {"role": "system", "content": "Be brief."}
