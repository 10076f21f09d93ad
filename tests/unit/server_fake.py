"""A fake AsyncLLM with the real one's interface, for fast tests of the HTTP layer.

Tokens are characters: a string prompt is its code points; generated token k of a request
is the letter ``"abcdefghij"[k % 10]`` (or, given a ``script``, its character k, stopping at its end);
a prompt containing "CRASH" raises a RuntimeError inside the engine. Each token takes ``token_delay``
seconds. Like the real one, it streams deltas.
"""

from __future__ import annotations

import asyncio

from kiln.errors import InvalidParamError
from kiln.runtime.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kiln.runtime.params import SamplingParams

LETTERS = "abcdefghij"


class FakeAsyncLLM:
    model_name = "fake-model"
    max_seq_len = 64

    def __init__(self, token_delay: float = 0.0, kv_blocks_total: int = 32, script: str | None = None):
        self.token_delay = token_delay
        self.script = script
        self.num_waiting = 0
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.generated = 0
        self.kv_blocks_total = kv_blocks_total
        self.shut_down = False
        self.requests: list[tuple[object, SamplingParams]] = []

    tool_family = None  # its template takes no tools: the server writes them Hermes-style

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if messages[-1]["role"] == "assistant" and messages[-1]["content"] == "REJECT":
            raise ValueError("template rejects this conversation")
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]  # 1: a BOS-like special token

    def detokenize(self, token_ids: list[int]) -> str:
        if any(t >= 0x110000 for t in token_ids):
            raise InvalidParamError("tokens must be in [0, 1114112)", "tokens")
        return "".join(chr(t) for t in token_ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [f"<{chr(t)}>" for t in token_ids]

    @property
    def max_prompt_chars(self) -> int:  # a character is a token
        return self.max_seq_len

    def add_request(self, prompt, params: SamplingParams, request_id: str):
        """Like AsyncLLM's: bad input is refused here, at once; the stream runs the request."""
        return self.add_prepared(self.prepare_request(prompt, params, request_id))

    def prepare_request(self, prompt, params: SamplingParams, request_id: str):
        """Tokenize and check (the server calls it on a worker thread)."""
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        max_tokens = params.max_tokens or (self.max_seq_len - len(ids))
        if len(ids) + max_tokens > self.max_seq_len:
            raise InvalidParamError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                    f"max_seq_len ({self.max_seq_len})",
                                    "prompt" if len(ids) >= self.max_seq_len else "max_tokens")
        return prompt, ids, max_tokens, params, request_id

    def add_prepared(self, prepared):
        return _Stream(self._run(*prepared))

    async def _run(self, prompt, ids: list[int], max_tokens: int, params: SamplingParams, request_id: str):
        if isinstance(prompt, str) and "CRASH" in prompt:
            raise RuntimeError("engine exploded")
        self.requests.append((prompt, params))
        self.running.add(request_id)
        texts = [""] * params.n
        toks: list[list[int]] = [[] for _ in range(params.n)]
        lps: list[list[dict]] = [[] for _ in range(params.n)]
        reasons: list[str | None] = [None] * params.n
        sent_chars, sent_toks = [0] * params.n, [0] * params.n
        try:
            while any(r is None for r in reasons):
                await asyncio.sleep(self.token_delay)
                if request_id not in self.running:
                    return
                for j in range(params.n):
                    if reasons[j] is not None:
                        continue
                    k = len(toks[j])
                    ch = self.script[k] if self.script else LETTERS[(k + j) % 10]
                    toks[j].append(ord(ch))
                    texts[j] += ch
                    self.generated += 1
                    if params.logprobs is not None:
                        step = {ord(ch): Logprob(-0.5, 1, ch)}
                        for r in range(1, params.logprobs):
                            alt = LETTERS[(k + j + r) % 10]
                            step[ord(alt)] = Logprob(-1.0 - r, r + 1, alt)
                        lps[j].append(step)
                    if any(s in texts[j] for s in params.stop):
                        stop = next(s for s in params.stop if s in texts[j])
                        texts[j] = texts[j][: texts[j].index(stop)]
                        reasons[j] = "stop"
                    elif self.script and len(toks[j]) == len(self.script):
                        reasons[j] = "stop"
                    elif len(toks[j]) >= max_tokens:
                        reasons[j] = "length"
                outs = [CompletionOutput(j, texts[j][sent_chars[j]:], toks[j][sent_toks[j]:], -0.5 * len(toks[j]),
                                         lps[j][sent_toks[j]:] if params.logprobs is not None else None,
                                         reasons[j]) for j in range(params.n)]
                for j in range(params.n):
                    sent_chars[j], sent_toks[j] = max(sent_chars[j], len(texts[j])), len(toks[j])
                done = all(r is not None for r in reasons)
                yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids, outs, done, 0)
            self.finished.append(request_id)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def stats(self) -> EngineStats:
        used = len(self.running)
        return EngineStats(num_running=used, num_waiting=self.num_waiting, kv_blocks_total=self.kv_blocks_total,
                           kv_blocks_used=used, prefix_cache_queries=10, prefix_cache_hits=4,
                           num_generated_tokens=self.generated, num_spec_verifications=4,
                           num_spec_proposed_tokens=16, num_spec_accepted_tokens=10)

    async def shutdown(self) -> None:
        self.shut_down = True


class _Stream:
    """AsyncLLM's RequestStream over the fake's generator: iterate it; close() before the start drops it."""

    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self.gen

    def close(self) -> None:
        self.gen = _empty()

    async def aclose(self) -> None:
        await self.gen.aclose()


async def _empty():
    return
    yield


async def post_completion_asgi(app, body: dict, on_message, gone: asyncio.Event) -> None:
    """POST ``body`` to /v1/completions over raw ASGI: ``on_message`` sees every message the app sends,
    and the client hangs up (http.disconnect) once ``gone`` is set."""
    import json

    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        on_message(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
