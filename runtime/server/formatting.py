"""OpenAI's response bodies and stream chunks, built from the engine's outputs: the choices (text, or a chat message
with reasoning split off and tool calls parsed), their logprobs objects, and the usage counts.
"""

from __future__ import annotations

import time
from typing import Any

from kiln.runtime.outputs import CompletionOutput, Logprob, RequestOutput, merge_completions
from kiln.runtime.params import SamplingParams
from kiln.runtime.server.reasoning import ReasoningSplitter
from kiln.runtime.server.tools import ToolResponses

# ---- logprobs ---------------------------------------------------------------------------

def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((rank, t, lp) for t, lp in step.items() if (rank := lp.rank) is not None), key=lambda x: x[0])
    return [(t, lp) for _, t, lp in ranked[:k]]


def _token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def completion_logprobs(out: CompletionOutput, start: int, k: int, text_offset: int) -> dict[str, Any]:
    """The completions API's logprobs object for generated tokens [start:]."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, step in zip(out.token_ids[start:], (out.logprobs or [])[start:], strict=True):
        sampled = step.get(token_id)
        text = _token_text(sampled) if sampled else ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob if sampled else None)
        top = {_token_text(lp): lp.logprob for _, lp in _top(step, k)}
        if sampled is not None:
            top.setdefault(text, sampled.logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _entry(lp: Logprob | None) -> dict[str, Any]:
    text = _token_text(lp) if lp else ""
    return {"token": text, "logprob": lp.logprob if lp else -9999.0, "bytes": list(text.encode())}


def chat_logprobs(out: CompletionOutput, start: int, k: int) -> dict[str, Any]:
    """The chat API's logprobs object for generated tokens [start:]."""
    content = []
    for token_id, step in zip(out.token_ids[start:], (out.logprobs or [])[start:], strict=True):
        item = _entry(step.get(token_id))
        item["top_logprobs"] = [_entry(lp) for _, lp in _top(step, k)]
        content.append(item)
    return {"content": content}


# ---- responses ---------------------------------------------------------------------------

class ResponseFormatter:
    """Builds OpenAI stream chunks from output deltas and response bodies from merged outputs."""

    def __init__(self, chat: bool, request_id: str, model: str, params: SamplingParams):
        self.chat, self.id, self.model, self.params = chat, request_id, model, params
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.sent: dict[int, int] = {}  # choice index -> characters streamed
        # deltas of tokens without text yet, merged once when text comes (their logprobs go with it)
        self.held: dict[int, list[CompletionOutput]] = {}
        self.tools: ToolResponses | None = None  # a chat request with tools: calls parsed out of the text
        self.reasoning: ReasoningSplitter | None = None  # a reasoning model's chat: <think> split out first

    def _logprobs(self, out: CompletionOutput, start_char: int) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(out, 0, self.params.logprobs)
        return completion_logprobs(out, 0, self.params.logprobs, start_char)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunks(self, prompt_index: int, ro: RequestOutput, include_usage: bool) -> list[dict[str, Any]]:
        """Stream chunks carrying what each choice of this output delta adds."""
        chunks = []
        for out in ro.outputs:
            index = prompt_index * self.params.n + out.index
            chars = self.sent.get(index, 0)
            if not out.text and out.finish_reason is None and index in self.sent:
                if out.token_ids:
                    self.held.setdefault(index, []).append(out)
                continue
            if index in self.held:
                out = merge_completions([*self.held.pop(index), out])
            delta = out.text
            choice: dict[str, Any] = {"index": index}
            reason = out.finish_reason
            if self.chat:
                choice["delta"], reason = self._chat_delta(index, delta, list(out.token_ids), out.finish_reason)
                if index not in self.sent:
                    choice["delta"] = {"role": "assistant", **choice["delta"]}
            else:
                choice["text"] = delta
            choice["logprobs"] = self._logprobs(out, chars)
            choice["finish_reason"] = reason
            self.sent[index] = chars + len(delta)
            chunk = self._head(self.object + ".chunk" if self.chat else self.object)
            chunk["choices"] = [choice]
            if include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def _chat_delta(self, index: int, text: str, token_ids: list[int], finish_reason: str | None
                    ) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's delta (without the role): reasoning split off, then tool calls held back and parsed."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.delta(index, text, finish_reason is not None)
            self.reasoning.stream_tokens.setdefault(index, []).extend(token_ids)
        if self.tools is not None:
            delta, reason = self.tools.delta(index, text, finish_reason)
        else:
            delta, reason = ({"content": text} if text or not thought else {}), finish_reason
        return ({"reasoning_content": thought, **delta} if thought else delta), reason

    def _chat_message(self, out: CompletionOutput) -> tuple[dict[str, Any], str | None, int]:
        """A whole choice's message and finish reason, and how many of its tokens were thinking."""
        thought, text, finish_reason, thinking_tokens = None, out.text, out.finish_reason, 0
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
            thinking_tokens = self.reasoning.reasoning_tokens(list(out.token_ids), thought is not None)
        if self.tools is not None:
            message, reason = self.tools.message(text, finish_reason)
        else:
            message, reason = {"role": "assistant", "content": text}, finish_reason
        if self.reasoning is not None:
            message["reasoning_content"] = thought
            if thought is not None and not message["content"]:
                message["content"] = None  # it only thought (cut short, or it answered with calls)
        return message, reason, thinking_tokens

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._head(self.object + ".chunk" if self.chat else self.object)
        if self.reasoning is not None:
            usage.reasoning = self.reasoning.streamed_reasoning_tokens()
        chunk.update(choices=[], usage=usage.as_dict())
        return chunk

    def response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices, thinking_tokens = [], 0
        for i in sorted(finals):
            for out in finals[i].outputs:
                choice: dict[str, Any] = {"index": i * self.params.n + out.index}
                reason = out.finish_reason
                if self.chat:
                    choice["message"], reason, thinking = self._chat_message(out)
                    thinking_tokens += thinking
                else:
                    choice["text"] = out.text
                choice["logprobs"] = self._logprobs(out, 0)
                choice["finish_reason"] = reason
                choice["stop_reason"] = out.stop_reason
                choices.append(choice)
        body = self._head(self.object)
        body.update(choices=choices, usage=_usage(finals, thinking_tokens if self.reasoning is not None else None))
        return body


class Usage:
    """A response's token counts, added up from its outputs (deltas or merged) as they come, so a
    stream keeps counts rather than its outputs."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}  # prompt index -> prompt tokens
        self.cached: dict[int, int] = {}  # prompt index -> of which served from the prefix cache
        self.completion = 0
        self.reasoning: int | None = None  # of completion, the thinking tokens (with a reasoning parser)

    def add(self, prompt_index: int, ro: RequestOutput) -> None:
        self.prompt[prompt_index] = len(ro.prompt_token_ids)
        self.cached[prompt_index] = ro.num_cached_tokens
        self.completion += sum(len(o.token_ids) for o in ro.outputs)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": self.completion,
                                 "total_tokens": prompt + self.completion,
                                 "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
        return usage


def _usage(finals: dict[int, RequestOutput], reasoning: int | None) -> dict[str, Any]:
    usage = Usage()
    for i, ro in finals.items():
        usage.add(i, ro)
    usage.reasoning = reasoning
    return usage.as_dict()
