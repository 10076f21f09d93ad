"""AsyncLLM: streaming generation for asyncio callers (the HTTP server sits on it).

The engine runs on its own thread; the event loop prepares requests (validation and
tokenization, so a bad request fails in the caller), posts commands to that thread and awaits
per-request queues, so it never blocks on a model step. Streams carry deltas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from kiln.runtime.detokenizer import ChatMessage, TextTokenizer, with_token_text
from kiln.runtime.engine import Engine, EngineRequest
from kiln.runtime.llm import as_engine
from kiln.runtime.outputs import EngineStats, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams


@dataclass
class _Add:
    request: EngineRequest


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

    def put(self, item: _StreamItem) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


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
        """Requests accepted but not yet running (for queue bounds)."""
        return self._pending_adds + len(self.engine.scheduler.waiting)

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_waiting += self._pending_adds
        return stats

    def apply_chat_template(self, messages: list[ChatMessage]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages)

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yield what each step adds (deltas; merge_outputs builds the whole) as tokens arrive;
        ValueError at once for bad input."""
        if self._closed:
            raise RuntimeError("AsyncLLM has been shut down")
        request = self.engine.prepare(request_id, prompt, params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds += 1
        self._inbox.put(_Add(request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield with_token_text(self.engine.tokenizer, item)
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))  # the client went away: free its blocks
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
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _handle(self, command: _Command) -> bool:
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            request_id = command.request.request_id
            with self._lock:
                self._pending_adds -= 1
                alive = request_id in self._streams
            if alive:
                try:
                    self.engine.add(command.request)
                except ValueError as exc:
                    self._deliver(request_id, exc)
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
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
            except Exception as exc:  # noqa: BLE001 - fail every request, keep serving
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {exc!r}"))
        for request_id in list(self.engine.requests):
            final = self.engine.abort(request_id)
            if final is not None:  # always, for a request the engine still holds
                self._deliver(request_id, final)
