"""Reasoning models' <think>...</think> split into reasoning_content: the splitter on whole answers and on every
way a stream can cut them, then through the app on a fake engine that writes a scripted answer, with the official
openai client: chat completions (whole and streamed, with tool calls after the thinking), the Responses API's
reasoning items and events, a constrained request left whole, and the parser's auto / on / off choice."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.reasoning import ReasoningSplitter, opens_thinking, reasoning_enabled  # noqa: E402

THOUGHT = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


@pytest.mark.parametrize(("text", "prompt_opens", "expected"), [
    (THOUGHT, False, ("The user greets me.\nI greet back.\n", "Hello there!")),
    ("  <think>a < b</think>Yes", False, ("a < b", "Yes")),
    ("Hello <think>not thinking</think>", False, (None, "Hello <think>not thinking</think>")),
    ("<think>cut short by max_tok", False, ("cut short by max_tok", "")),
    ("thinking already</think>\nAnswer", True, ("thinking already", "Answer")),  # the template opened it
    ("still thinking", True, ("still thinking", "")),
    ("", False, (None, "")),
    ("<thin", False, (None, "<thin")),
])
def test_split_whole_answers(text, prompt_opens, expected):
    assert ReasoningSplitter(prompt_opens, _chars).split(text) == expected


@pytest.mark.parametrize("text", [THOUGHT, "  <think>a</think>", "Plain <answer>", "<thi", "x</think>y"])
@pytest.mark.parametrize("prompt_opens", [False, True])
def test_every_stream_cut_gives_the_whole_split(text, prompt_opens):
    reasoning, content = ReasoningSplitter(prompt_opens, _chars).split(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        splitter = ReasoningSplitter(prompt_opens, _chars)
        deltas = [splitter.delta(0, p, False) for p in pieces] + [splitter.delta(0, "", True)]
        assert "".join(r for r, _ in deltas) == (reasoning or ""), pieces
        assert "".join(c for _, c in deltas) == content, pieces


def _chars(ids: list[int]) -> str:  # the fake engine's tokens are characters
    return "".join(map(chr, ids))


def test_reasoning_tokens_are_counted_to_the_closing_tag():
    splitter = ReasoningSplitter(False, _chars)
    ids = [ord(c) for c in THOUGHT]
    assert splitter.reasoning_tokens(ids, True) == THOUGHT.index("</think>") + len("</think>")
    assert splitter.reasoning_tokens(ids[:20], True) == 20  # never closed: all of it
    assert splitter.reasoning_tokens(ids, False) == 0


def test_a_prompt_opens_thinking_when_its_last_think_is_open():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<think>\n\n</think>\n\n")  # Qwen3 with thinking off: an empty, closed block
    assert not opens_thinking("<|im_start|>assistant\n")


class _Vocab:
    def __init__(self, tokens: set[str]):
        self.tokens = tokens

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] if text in self.tokens else [ord(c) for c in text]


def test_auto_reads_a_real_tokenizer(tmp_path):
    """A tiny byte-level tokenizer spells <think> in pieces; with both tags added as tokens (as Qwen3's has them)
    auto turns the parser on."""
    from helpers import write_tiny_tokenizer
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from kiln.runtime.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    plain = Tokenizer(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    thinking = Tokenizer(tmp_path)
    assert not reasoning_enabled("auto", _Encoder(plain)) and reasoning_enabled("auto", _Encoder(thinking))


class _Encoder:
    def __init__(self, tokenizer):
        self.tokenize = tokenizer.encode


def test_auto_turns_on_for_a_tokenizer_with_both_tags():
    assert reasoning_enabled("auto", _Vocab({"<think>", "</think>"}))
    assert not reasoning_enabled("auto", _Vocab({"<think>"}))
    assert reasoning_enabled("qwen3", _Vocab(set())) and not reasoning_enabled("none", _Vocab({"<think>", "</think>"}))
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_enabled("deepseek", _Vocab(set()))


# ---- through the app --------------------------------------------------------------------------------------

def _client(script: str, parser: str = "qwen3"):
    """The app `kiln serve --reasoning-parser PARSER` runs, on the fake engine writing `script`."""
    pytest.importorskip("uvicorn")
    from kiln.runtime.server.launch import ServeOptions, serving_app

    fake = FakeAsyncLLM(script=script)
    fake.max_seq_len = 2048
    return TestClient(serving_app(lambda: fake, ServeOptions(reasoning_parser=parser, web_ui=False)))


def official(http: TestClient):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_splits_reasoning_whole_and_streamed():
    with _client(THOUGHT) as http:
        oai = official(http)
        message = oai.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message
        assert message.content == "Hello there!"
        assert message.model_extra["reasoning_content"] == "The user greets me.\nI greet back.\n"
        chunks = list(oai.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert thought == message.model_extra["reasoning_content"]
        assert "".join(d.content or "" for d in deltas) == "Hello there!"
        first_content = next(i for i, d in enumerate(deltas) if d.content)
        assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])
        assert chunks[-1].choices[0].finish_reason == "stop"
        thinking = THOUGHT.index("</think>") + len("</think>")
        usage = oai.chat.completions.create(model="fake-model", messages=MESSAGES).usage
        assert usage.completion_tokens == len(THOUGHT) and usage.completion_tokens_details.reasoning_tokens == thinking
        streamed = list(oai.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                                    stream_options={"include_usage": True}))
        assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == thinking


def test_parser_off_leaves_the_text_whole():
    for parser in ("none", "auto"):  # the fake's vocabulary spells <think> in characters: auto is off
        with _client(THOUGHT, parser) as http:
            message = official(http).chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message
            assert message.content == THOUGHT and "reasoning_content" not in (message.model_extra or {})
            constrained = official(http).chat.completions.create(
                model="fake-model", messages=MESSAGES, extra_body={"guided_regex": "(.|\n)*"}).choices[0].message
            assert constrained.content == THOUGHT


def test_a_constraint_on_a_model_whose_tags_are_no_tokens_is_refused_naming_its_field():
    """The grammar finds the thought's end by the </think> token: spelled in pieces, it cannot (a 400, not a
    constraint silently dropped or applied to the thinking); test_structured_output.py has the grammar
    after a real thought."""
    with _client(THOUGHT) as http:
        with pytest.raises(openai.BadRequestError) as info:
            official(http).chat.completions.create(model="fake-model", messages=MESSAGES,
                                                   extra_body={"guided_regex": ".*"})
        assert info.value.body["param"] == "guided_regex" and "--reasoning-parser none" in info.value.body["message"]
        assert official(http).chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
THEN_CALL = '<think>I need the time.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_thinking_then_a_tool_call():
    with _client(THEN_CALL) as http:
        oai = official(http)
        choice = oai.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL]).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_time"
        assert choice.message.model_extra["reasoning_content"] == "I need the time."
        chunks = list(oai.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL], stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "I need the time."
        assert not "".join(d.content or "" for d in deltas).strip()
        assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["get_time"]


def test_responses_api_reasoning_items_whole_and_streamed():
    with _client(THOUGHT) as http:
        oai = official(http)
        response = oai.responses.create(model="fake-model", input="hi")
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "The user greets me.\nI greet back.\n"
        assert response.output_text == "Hello there!"
        thinking = THOUGHT.index("</think>") + len("</think>")
        assert response.usage.output_tokens_details.reasoning_tokens == thinking
        events = list(oai.responses.create(model="fake-model", input="hi", stream=True))
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == response.output[0].content[0].text
        added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
        assert added == [(0, "reasoning"), (1, "message")]
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert final.usage.output_tokens_details.reasoning_tokens == thinking
        assert final.output[0].id.startswith("rs_")
        # the Agents SDK sends the reasoning item back in the next turn's input: it is accepted and dropped
        follow = oai.responses.create(model="fake-model", input=[
            {"role": "user", "content": "hi"}, json.loads(response.output[0].model_dump_json()),
            {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "again"}])
        assert follow.status == "completed"
