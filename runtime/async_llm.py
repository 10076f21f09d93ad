"""AsyncLLM: streaming generation for asyncio callers (the HTTP server sits on it).

The engine runs on its own thread; the event loop prepares requests (validation and
tokenization, so a bad request fails in the caller), posts commands to that thread and awaits
per-request queues, so it never blocks on a model step. Streams carry deltas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidParamError, RequestFailedError
from kiln.runtime.detokenizer import ChatMessage, TextTokenizer, max_prompt_chars, with_token_text
from kiln.runtime.engine import Engine, EngineRequest
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.llm import as_engine
from kiln.runtime.outputs import EngineStats, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass
class _Add:
    request: EngineRequest
    kv: KvHandoff | None = None
    export_kv: bool = False


@dataclass
class _Abort:
    request_id: str
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


class _Stop:
    """The command that ends the engine thread."""


_STOP = _Stop()
_Command = _Add | _Abort | _Stop
_StreamItem = RequestOutput | BaseException  # an output delta, or the error that ends the stream


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[_StreamItem] = asyncio.Queue()


def _put_all(batch: list[tuple[_Stream, _StreamItem]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


class RequestStream:
    """The output deltas of one queued request (AsyncLLM.add_request), as an async iterator.

    Closing it before its last output aborts the request and frees its blocks; the engine's
    rejection or failure of the request is raised from ``__anext__``.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream) -> None:
        self._llm, self.request_id, self._stream = llm, request_id, stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self._release(abort=False)  # the engine refused or failed it: it holds nothing
            raise item
        if item.finished:
            self._release(abort=False)
        return with_token_text(self._llm.tokenizer, item)

    def close(self) -> None:
        """Stop listening; a request that has not finished is aborted."""
        if not self._done:
            self._release(abort=True)

    async def aclose(self) -> None:
        self.close()

    def _release(self, abort: bool) -> None:
        self._done = True
        self._llm._release(self.request_id, abort)


class AsyncLLM:
    def __init__(self, engine: str | Path | Engine, config: RuntimeConfig | None = None) -> None:
        """engine: an engine directory (loaded with config) or an already built Engine."""
        self.engine = as_engine(engine, config)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()
        self.max_prompt_chars = max_prompt_chars(self.engine.tokenizer, self.engine.runner.vocab_size,
                                                 self.max_seq_len)

    # -- properties -------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.engine.tokenizer

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running (for queue bounds). Exact at the moment of the call:
        a request is counted from add_request until the scheduler starts it."""
        with self._lock:
            return self._pending_adds + len(self.engine.scheduler.waiting)

    @property
    def engine_thread_alive(self) -> bool:
        """False once the engine thread has ended (shutdown, or a crash that escaped the step's handler)."""
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_waiting += self._pending_adds
        return stats

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)

    @property
    def tool_family(self) -> str | None:
        """The chat template's tool-call syntax when it takes tools (ChatTemplate.tool_family), else None."""
        return self.engine.tokenizer.tool_family

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included; InvalidParamError for an id outside the vocabulary."""
        vocab = self.engine.runner.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParamError(f"tokens must be in [0, {vocab}), got {bad}", "tokens")
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (e.g. "Ġworld"), as vLLM's /tokenize returns them."""
        return [self.engine.tokenizer.id_to_token(t) or "" for t in token_ids]

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    kv: KvHandoff | None = None) -> RequestStream:
        """Validate, tokenize and queue a request now (InvalidParamError / ValueError at once for bad
        input; num_waiting counts it on return); iterate the returned stream for its deltas.
        kv: the prompt's KV and first token from a prefill engine (AsyncLLM.prefill): decoding starts on them."""
        return self.add_prepared(self.prepare_request(prompt, params, request_id), kv)

    def prepare_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                        images: list[Image] | None = None) -> EngineRequest:
        """add_request's first half, for any thread (tokenizing a long prompt is slow: the HTTP server does
        it off its event loop): tokenize and check, and encode the images of a vision-language engine's
        request; InvalidParamError naming the problem."""
        return self.engine.prepare(request_id, prompt, params, images)

    @property
    def image_token(self) -> str | None:
        """The image placeholder's text (a vision-language engine's; None for a text engine)."""
        return self.engine.image_token

    @property
    def image_placeholder(self) -> str | None:
        """The text a chat message's image part becomes (a vision-language engine's; None for a text engine)."""
        return self.engine.image_placeholder

    @property
    def allowed_media_dir(self) -> Path | None:
        """Where file:// image URLs may point (RuntimeConfig.allowed_media_path, resolved), or None."""
        return self.engine.config.media_dir()

    def add_prepared(self, request: EngineRequest, kv: KvHandoff | None = None) -> RequestStream:
        """add_request's second half, on the event loop: queue a prepared request (num_waiting counts it)."""
        return self._queue(request, kv, export_kv=False)

    async def prefill(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> KvHandoff:
        """Compute the prompt and its first token only, and return them with the prompt's KV for another
        engine to decode from (add_request(..., kv=)); the blocks here are freed (prefix-cached) after."""
        params = dataclasses.replace(params, max_tokens=1, n=1)
        stream = self._queue(self.engine.prepare(request_id, prompt, params), None, export_kv=True)
        try:
            async for output in stream:
                if output.kv_handoff is not None:
                    return output.kv_handoff
        finally:
            stream.close()
        raise RuntimeError(f"request {request_id} ended before its first token (aborted)")

    def _queue(self, request: EngineRequest, kv: KvHandoff | None, export_kv: bool) -> RequestStream:
        if self._closed:
            raise RuntimeError("AsyncLLM has been shut down")
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds += 1
        self._inbox.put(_Add(request, kv, export_kv))
        return RequestStream(self, request_id, stream)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yield what each step adds (deltas; merge_outputs builds the whole) as tokens arrive;
        ValueError at the first iteration for bad input. Leaving the loop early aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _release(self, request_id: str, abort: bool) -> None:
        if abort:
            self._inbox.put(_Abort(request_id))  # the listener went away: free its blocks
        with self._lock:
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort") and free its blocks."""
        command = _Abort(request_id)
        self._inbox.put(command)
        await asyncio.wrap_future(command.done)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.runner.close()

    # -- the engine thread ------------------------------------------------------------------

    def _deliver(self, request_id: str, item: _StreamItem) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, _StreamItem]]) -> None:
        """Each item to its request's stream, in one wake-up of the listening event loop: a step's outputs go
        together, so a step advancing many requests wakes the loop (a thread switch, and a GIL hand-over from
        this thread) once, not once per request."""
        with self._lock:
            found = [(self._streams.get(request_id), item) for request_id, item in items]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _StreamItem]]] = {}
        for stream, item in found:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _handle(self, command: _Command) -> bool:
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            request_id = command.request.request_id
            with self._lock:  # one step, so num_waiting never sees the request in neither count
                self._pending_adds -= 1
                error = None
                if request_id in self._streams:
                    try:
                        self.engine.add(command.request, command.kv, command.export_kv)
                    except ValueError as exc:
                        error = exc
            if error is not None:
                self._deliver(request_id, error)
        else:
            output = self.engine.abort(command.request_id)
            if output is not None:
                self._deliver(command.request_id, output)
            command.done.set_result(None)
        return True

    def _loop(self) -> None:
        running = True
        while running:
            try:
                block = not self.engine.has_unfinished()
                command = self._inbox.get(block=block)
                running = self._handle(command)
                while running:
                    running = self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not running:
                break
            try:
                outputs = self.engine.step()
                self._deliver_all([(output.request_id, output if output.error is None else
                                    RequestFailedError(output.error)) for output in outputs])
            except Exception as exc:  # noqa: BLE001 - fail every request, keep serving
                failed: list[tuple[str, _StreamItem]] = []
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    failed.append((request_id, RuntimeError(f"engine step failed: {exc!r}")))
                self._deliver_all(failed)
        for request_id in list(self.engine.requests):
            final = self.engine.abort(request_id)
            if final is not None:  # always, for a request the engine still holds
                self._deliver(request_id, final)
