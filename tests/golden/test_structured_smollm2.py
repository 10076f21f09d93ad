"""Structured output and tool calling with SmolLM2 through `kiln serve` and the official openai client: a Pydantic
model parsed from a greedy and a sampled answer, 50 drawn JSON schemas each answered greedy and sampled, a regex
and a grammar, a forced tool call whose arguments validate (streamed and not), and the Responses API's text answer;
through the Python API, tool calls parsed by LLM.chat and the outputs that stop validating without the mask."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemas import bounded_schemas  # noqa: E402
from server_process import Server  # noqa: E402

pytestmark = pytest.mark.slow


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    city: Literal["Paris", "London", "Berlin"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_engine, tmp_path_factory):
    srv = Server(smollm2_engine, tmp_path_factory.mktemp("structured-smollm2") / "server.log",
                 "--served-model-name", "smol")
    yield srv
    assert srv.stop() == 0


def test_parse_gives_the_pydantic_object(server):
    client = server.client()
    for temperature in (0.0, 0.8):
        done = client.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": "Invent a person who lives in Paris."}],
            response_format=Person, temperature=temperature, seed=2, max_tokens=80)
        person = done.choices[0].message.parsed
        assert isinstance(person, Person), done.choices[0].message.content


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=bounded_schemas)
def test_drawn_schemas_validate_greedy_and_sampled(server, schema):
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "drawn", "schema": schema, "strict": True}}

    def answer(temperature: float) -> str:
        done = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Answer in JSON."}], response_format=response_format,
            temperature=temperature, seed=11, max_tokens=200)
        assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
        return str(done.choices[0].message.content)

    with ThreadPoolExecutor(2) as pool:  # greedy and sampled batched together, as clients would send them
        for text in pool.map(answer, (0.0, 1.0)):
            jsonschema.validate(json.loads(text), schema)


def test_regex_and_grammar_requests_match(server):
    client = server.client()
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    done = client.completions.create(model="smol", prompt="A city and a number:", max_tokens=20, temperature=0.8,
                                     seed=3, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, done.choices[0].text), done.choices[0].text
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[0-9]{1,2}/'
    done = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Add some numbers."}],
                                          max_tokens=40, temperature=0, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2})*\)", done.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_arguments_validate(server, stream):
    client = server.client()
    kwargs = dict(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            done = events.get_final_completion()
    else:
        done = client.chat.completions.create(**kwargs)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_call_round_trip_answers(server):
    client = server.client()
    called = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=80).choices[0].message
    history = [*ASK, called.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": called.tool_calls[0].id,
                "content": '{"temperature_c": 18, "sky": "clear"}'}]
    answer = client.chat.completions.create(model="smol", messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=40).choices[0]
    assert answer.message.content and answer.message.tool_calls is None, answer


def test_responses_api_answers(server):
    answer = server.client().responses.create(model="smol", input="Say hello.", max_output_tokens=16, temperature=0)
    assert answer.output_text.strip() and answer.usage.output_tokens <= 16


@pytest.fixture(scope="module")
def llm(smollm2_engine):
    from kiln.runtime.llm import LLM

    return LLM(smollm2_engine)


def test_python_chat_returns_parsed_calls_and_a_round_trip_answers(llm):
    from kiln.runtime.params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=80)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        [out] = llm.chat(ASK, greedy, tools=[WEATHER], tool_choice=choice)
        [call] = out.outputs[0].tool_calls
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 18, "sky": "clear"}'}]
    [answer] = llm.chat(history, SamplingParams(temperature=0, max_tokens=40), tools=[WEATHER])
    assert answer.outputs[0].text.strip() and answer.outputs[0].tool_calls is None
    [plain] = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8))
    assert plain.outputs[0].tool_calls is None


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"name": "f"}}], "auto", "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "auto",
     "tools.0.function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_python_chat_refuses_bad_tools_naming_the_field(llm, tools, choice, param):
    from kiln.errors import InvalidParamError

    with pytest.raises(InvalidParamError) as info:
        llm.chat(ASK, tools=tools, tool_choice=choice)
    assert info.value.param == param


def test_smollm2_output_stops_validating_without_the_mask(llm, monkeypatch):
    from kiln.runtime.params import SamplingParams
    from kiln.runtime.structured import StructuredOutput
    from kiln.runtime.structured.grammar import MaskStep

    schema = Person.model_json_schema()
    params = SamplingParams(temperature=0, max_tokens=60, structured=StructuredOutput.json_schema(schema))
    ask = [{"role": "user", "content": "Invent a person who lives in Paris."}]
    [masked] = llm.chat(ask, params)
    Person.model_validate_json(masked.outputs[0].text)
    monkeypatch.setattr(MaskStep, "apply", lambda self, logits, states: None)
    [unmasked] = llm.chat(ask, params)
    assert unmasked.error is not None and "left the grammar" in unmasked.error  # SmolLM2 answers in prose
