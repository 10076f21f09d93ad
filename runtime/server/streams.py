"""One HTTP request's engine requests, merged into one stream, and that stream as server-sent events.

The stream ends early in three ways, each with its own exception: the client leaves
(ClientDisconnected: nothing more is sent), the server's shutdown deadline passes
(ServerShuttingDown: a streaming client gets an error event and ``[DONE]``), or the engine
rejects or fails a request (its exception). On any exit the unfinished engine requests are
aborted, so their KV blocks are freed, and the request is logged in one line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import anyio
from starlette.requests import Request

from kiln.errors import InvalidParamError
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.params import SamplingParams
from kiln.runtime.server.formatting import ResponseFormatter, Usage
from kiln.runtime.server.metrics import RequestTimer
from kiln.runtime.server.protocol import error_body

log = logging.getLogger("kiln.server")


class ClientDisconnected(Exception):
    pass


class ServerShuttingDown(Exception):
    """The shutdown deadline passed while the request was still running."""


class Drain:
    """The shutdown deadline: ``start`` is called when the server begins shutting down; requests
    still running ``timeout`` seconds later are ended (streams with an error event and [DONE])."""

    def __init__(self) -> None:
        self.expired = asyncio.Event()
        self.timeout = 0.0

    def start(self, timeout: float) -> None:
        self.timeout = timeout
        asyncio.get_running_loop().call_later(timeout, self.expired.set)

    def error(self) -> ServerShuttingDown:
        return ServerShuttingDown(f"The server is shutting down and its {self.timeout:g} s deadline for running "
                                  "requests has passed; this request was cut short.")


class OutputStream(Protocol):
    """AsyncLLM.add_request's RequestStream: output deltas; closing it early aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


EngineStream = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output delta)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _abort(llm: Any, request_id: str) -> None:
    try:
        with anyio.move_on_after(5.0):  # never hang a handler on an engine that is going away
            await llm.abort(request_id)
    except Exception:  # already finished or unknown: nothing to free
        log.debug("abort(%s) failed", request_id, exc_info=True)


class _RequestLog:
    """What the one log line of a request says: tokens in and out, finish reasons, latency."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.start = time.perf_counter()
        self.prompt_tokens = self.output_tokens = 0
        self.finish_reasons: list[str] = []

    def write(self) -> None:
        log.info("%s: prompt_tokens=%d output_tokens=%d finish_reason=%s latency=%.3fs", self.request_id,
                 self.prompt_tokens, self.output_tokens, ",".join(self.finish_reasons) or "none",
                 time.perf_counter() - self.start)


async def engine_stream(request: Request, streams: list[OutputStream], ids: list[str], params: SamplingParams,
                        base_id: str) -> EngineStream:
    """Merged (prompt index, output delta) stream of already queued engine requests (one per prompt).

    Raises ClientDisconnected when the client leaves and ServerShuttingDown at the shutdown
    deadline; on any exit, aborts what is unfinished.
    """
    state = request.app.state
    llm, metrics, drain = state.llm, state.metrics, state.drain
    timers = [RequestTimer(metrics) for _ in streams]
    record = _RequestLog(base_id)
    # (prompt index, output delta or None once its stream ends, the exception that ended it)
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in streams[i]:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))  # ended (normally after a finished output)
        except Exception as e:  # handed to the consumer, which raises it in the handler
            queue.put_nowait((i, None, e))
        finally:
            await streams[i].aclose()

    live = set(range(len(streams)))
    started: set[int] = set()
    num_tokens = [0] * len(streams)
    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    watcher = asyncio.create_task(_wait_disconnect(request))
    deadline = asyncio.create_task(drain.expired.wait())
    try:
        while live:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait((get, watcher, deadline), return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                raise ClientDisconnected() if watcher in done else drain.error()
            i, out, err = get.result()
            if err is not None:
                live.discard(i)  # the engine rejected or failed it: nothing left to abort there
                raise err
            if out is None:
                live.discard(i)
                continue
            if i not in started:
                started.add(i)
                metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                record.prompt_tokens += len(out.prompt_token_ids)
            new = sum(len(o.token_ids) for o in out.outputs)
            num_tokens[i] += new
            record.output_tokens += new
            timers[i].on_tokens(num_tokens[i])
            if out.finished:
                live.discard(i)
                reasons = [o.finish_reason for o in out.outputs]
                timers[i].on_finish(reasons)
                record.finish_reasons += [r or "unknown" for r in reasons]
            yield i, out
    finally:
        watcher.cancel()
        deadline.cancel()
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            for i in live:
                metrics.aborted.inc(params.n)
                record.finish_reasons += ["abort"] * params.n
                await _abort(llm, ids[i])
            await asyncio.gather(*tasks, watcher, deadline, return_exceptions=True)
        record.write()


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def sse_stream(first: tuple[int, RequestOutput], stream: EngineStream, fmt: ResponseFormatter,
                     include_usage: bool) -> AsyncIterator[str]:
    usage = Usage()
    try:
        item = first
        while True:
            usage.add(*item)
            for chunk in fmt.chunks(item[0], item[1], include_usage):
                yield sse(chunk)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield sse(fmt.usage_chunk(usage))
    except ClientDisconnected:
        return
    except InvalidParamError as e:  # headers are sent: report in-band, then end the stream
        yield sse(error_body(400, str(e), e.param))
    except ServerShuttingDown as e:
        yield sse(error_body(503, str(e), code="server_shutting_down"))
    except Exception as e:
        log.exception("request %s failed mid-stream", fmt.id)
        yield sse(error_body(500, str(e) or type(e).__name__))
    finally:
        await stream.aclose()
    yield sse("[DONE]")
