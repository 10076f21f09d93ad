"""Structured output and tool calling through `kiln serve` on the tiny engine, with the official openai client:
response_format (json_schema with a Pydantic model through .parse, json_object), vLLM's guided_* extras, forced
tool calls (required and named, streamed and not) whose arguments validate, a call -> tool message -> answer
round trip, bad constraints answered 400 naming the field while other requests go on, and `kiln generate
--json-schema`. The tiny model's weights are random: only the constraint makes its text valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402

from kiln.cli import main  # noqa: E402


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    celsius: int = pydantic.Field(ge=-40, le=50)
    sunny: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    srv = Server(tiny_engine, tmp_path_factory.mktemp("structured") / "server.log", "--num-threads", "1",
                 "--served-model-name", "tiny")
    yield srv
    assert srv.stop() == 0


def _arguments_validate(call, tool) -> None:
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_parse_returns_the_pydantic_object_greedy_and_sampled(server):
    client = server.client()
    for temperature in (0.0, 1.0):
        done = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Weather,
                                             temperature=temperature, seed=1, max_tokens=60)
        assert isinstance(done.choices[0].message.parsed, Weather), done.choices[0].message.content


def test_json_object_and_guided_extras_on_both_endpoints(server):
    client = server.client()
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                          response_format={"type": "json_object"}).choices[0]
    if text.finish_reason == "stop":
        assert isinstance(json.loads(text.message.content), dict)
    else:  # the random model may fill an object past max_tokens; what it wrote is still an object's start
        assert text.message.content.startswith("{")
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0,
                                      extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"}).choices[0].text
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex)
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=3, temperature=1.0,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert {c.message.content for c in choice.choices} <= {"yes", "no"}
    grammar = client.completions.create(model="tiny", prompt="Sum:", max_tokens=20, temperature=1.0, extra_body={
        "guided_grammar": 'start: num ("+" num)*\nnum: /[1-9]/'}).choices[0]
    assert grammar.finish_reason == "length" or re.fullmatch(r"[1-9](\+[1-9])*", grammar.text)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_validate(server, stream):
    client = server.client()
    for choice, tools in (("required", [WEATHER_TOOL, TIME_TOOL]),
                          ({"type": "function", "function": {"name": "get_weather"}}, [WEATHER_TOOL, TIME_TOOL])):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=120, temperature=0)
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                done = events.get_final_completion()
        else:
            done = client.chat.completions.create(**kwargs)
        first = done.choices[0]
        assert first.finish_reason == "tool_calls" and first.message.tool_calls, first
        for call in first.message.tool_calls:
            _arguments_validate(call, WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL)
        if not isinstance(choice, str):
            assert [c.function.name for c in first.message.tool_calls] == ["get_weather"]


def test_a_call_round_trip_answers_in_text(server):
    client = server.client()
    call = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                          temperature=0).choices[0].message
    assert len(call.tool_calls) == 1
    history = [*MESSAGES, call.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"celsius": 21}'}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL], max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 0


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"extra_body": {"guided_regex": "a["}}, "guided_regex", "unclosed character class"),
    ({"extra_body": {"guided_grammar": "start: foo"}}, "guided_grammar", "unknown name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.function.parameters", "Field required"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     "at most one"),
])
def test_bad_constraints_are_400s_naming_the_field_and_others_go_on(server, body, param, words):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **body)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_the_loaded_engine_has_its_grammar_tokenizer_built(tiny_engine):
    """load_engine builds llguidance's tokenizer (and its first mask) while the model opens and waits for it, so
    the first structured request compiles its spec against a ready tokenizer."""
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import SamplingParams
    from kiln.runtime.structured import StructuredOutput

    engine = load_engine(tiny_engine)
    grammars = engine.grammars
    assert grammars is not None and grammars.tokenizer_ready
    prepared = engine.prepare("r", "x", SamplingParams(structured=StructuredOutput.json_object()))
    assert prepared.grammar is not None and engine.grammars is grammars  # the loader's compiler serves requests


def test_generate_json_schema_from_the_cli(tiny_engine, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "Answer:", "--max-tokens", "30",
                                       "--json-schema", str(tmp_path / "schema.json")])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout.strip()), schema)
    bad = CliRunner().invoke(main, ["generate", str(tiny_engine), "x", "--regex", "a[", "--max-tokens", "4"])
    assert bad.exit_code != 0 and "regex" in bad.output and "unclosed character class" in bad.output


def test_responses_api_text_tools_json_and_a_round_trip(server):
    client = server.client()
    text = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0)
    assert text.status == "incomplete" and text.output_text and text.usage.output_tokens == 6
    forced = client.responses.create(model="tiny", input="Weather in Paris?", tool_choice="required",
                                     tools=[{"type": "function", **WEATHER_TOOL["function"]}], max_output_tokens=120,
                                     temperature=0, parallel_tool_calls=False)
    [call] = [item for item in forced.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])
    answer = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, tools=[
        {"type": "function", **WEATHER_TOOL["function"]}], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    # the history (the call and its output) is in the prompt, after the same tools prompt
    assert answer.output[0].type == "message" and answer.usage.input_tokens > forced.usage.input_tokens + 20
    parsed = client.responses.parse(model="tiny", input="Weather?", text_format=Weather, max_output_tokens=60,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Weather)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


def test_responses_api_streams_text_and_call_events(server):
    client = server.client()
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0,
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, as OpenAI says it
    assert "".join(deltas) == events[-1].response.output_text and events[-1].response.usage.output_tokens == 6
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    with client.responses.stream(model="tiny", input="Weather?", tool_choice="required", max_output_tokens=120,
                                 tools=[{"type": "function", **WEATHER_TOOL["function"]}], temperature=0) as events:
        kinds = [e.type for e in events]
        final = events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    for item in final.output:
        assert item.type == "function_call"
        jsonschema.validate(json.loads(item.arguments), WEATHER_TOOL["function"]["parameters"])
