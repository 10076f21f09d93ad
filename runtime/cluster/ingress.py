"""ClusterLLM: what the HTTP app of runtime/server/ runs on in `kiln serve --replicas` (AsyncLLM's surface).

Requests are checked and tokenized here, once (the same prepare_request as one engine), hashed into their
prompt's chained block hashes for the router, and sent to the engine deployment through a Ray Serve handle
(whose request router is router.py's). With disaggregation, a prefill replica first computes the prompt and
its KV, and the engine (decode) deployment takes the handoff straight from Ray's object store.

A replica that dies ends its streams with ReplicaFailed (the app answers 500, or an error event and
[DONE] in a stream); Serve replaces it and routes new requests to the others meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kiln.errors import InvalidParamError
from kiln.runtime.block_manager import prompt_block_hashes
from kiln.runtime.cluster.protocol import ReplicaInfo, ReplicaRequest
from kiln.runtime.cluster.replica import ReplicaStats
from kiln.runtime.detokenizer import ChatMessage, TextTokenizer, max_prompt_chars
from kiln.runtime.engine import EngineRequest, prepare_request
from kiln.runtime.outputs import EngineStats, RequestOutput
from kiln.runtime.params import SamplingParams


class ReplicaFailed(RuntimeError):
    """The replica serving a request died or became unreachable before the request finished."""


class ClusterStream:
    """One request's output deltas from its replica; closing it early cancels the call there (an abort)."""

    def __init__(self, llm: ClusterLLM, request_id: str, response: DeploymentResponseGenerator[Any]) -> None:
        self._llm, self.request_id, self._response = llm, request_id, response
        self._done = False

    def __aiter__(self) -> ClusterStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output: RequestOutput = await self._response.__anext__()
        except StopAsyncIteration:
            self._release()
            raise
        except ray.exceptions.RayTaskError as exc:  # the replica raised: hand on its own exception
            self._release()
            cause = getattr(exc, "cause", None)
            if isinstance(cause, InvalidParamError):
                raise InvalidParamError(str(cause), cause.param) from None
            if isinstance(cause, ray.exceptions.RayError):
                raise ReplicaFailed(_failure(self.request_id, cause)) from None
            raise RuntimeError(f"the replica failed request {self.request_id}: {cause!r}") from None
        except ray.exceptions.RayError as exc:
            self._release()
            raise ReplicaFailed(_failure(self.request_id, exc)) from None
        self._llm._started(self.request_id)
        if output.finished:
            self._release()
        return output

    def close(self) -> None:
        if not self._done:
            self._response.cancel()  # type: ignore[no-untyped-call]
            self._release()

    async def aclose(self) -> None:
        self.close()

    def _release(self) -> None:
        self._done = True
        self._llm._release(self.request_id)


def _failure(request_id: str, exc: BaseException) -> str:
    return (f"the replica serving request {request_id} failed before it finished ({type(exc).__name__}); "
            "the cluster replaces it, retry the request")


class ClusterLLM:
    """engine: the handle of the engine deployment (decode, with disaggregation); prefill: the prefill
    deployment's handle, or None. Every replica serves the same engine dir with the same config (info)."""

    def __init__(self, engine: DeploymentHandle[Any], info: ReplicaInfo, tokenizer: TextTokenizer,
                 prefill: DeploymentHandle[Any] | None = None, stats_period_s: float = 1.0) -> None:
        self._engine, self._prefill = engine, prefill
        self.info = info
        self.tokenizer = tokenizer
        self._streams: dict[str, ClusterStream] = {}
        self._unstarted: set[str] = set()  # sent, no output yet: queued in Serve or in a replica's scheduler
        self._stats = EngineStats()
        self._stats_at = -float("inf")
        self._stats_period_s = stats_period_s
        self._refreshing: asyncio.Task[None] | None = None
        self.max_prompt_chars = max_prompt_chars(tokenizer, info.vocab_size, info.max_seq_len)

    # -- what build_app reads ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    @property
    def num_waiting(self) -> int:
        return len(self._unstarted)

    def stats(self) -> EngineStats:
        """The replicas' summed engine stats, as of the last refresh (one is started when they are older than
        stats_period_s, so a scrape never waits on the replicas)."""
        if time.monotonic() - self._stats_at > self._stats_period_s and self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_in_background())
        return self._stats

    async def replica_stats(self, deployment: str = "engine") -> list[ReplicaStats]:
        """Each live replica's stats now (deployment: "engine" or "prefill")."""
        handle = self._prefill if deployment == "prefill" else self._engine
        if handle is None:
            return []
        results = await handle.broadcast("stats").results_async(timeout_s=30.0, return_exceptions=True)
        return [r for r in results if isinstance(r, ReplicaStats)]  # a replica dying meanwhile: left out

    async def refresh_stats(self) -> EngineStats:
        per_replica = await self.replica_stats("engine") + await self.replica_stats("prefill")
        total = EngineStats()
        for s in per_replica:
            for f in dataclasses.fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s.stats, f.name))
        self._stats, self._stats_at = total, time.monotonic()
        return total

    async def _refresh_in_background(self) -> None:
        try:
            await self.refresh_stats()
        except Exception:  # noqa: BLE001 - a replica restarting: keep the last figures
            self._stats_at = time.monotonic()
        finally:
            self._refreshing = None

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)

    @property
    def tool_family(self) -> str | None:
        """The chat template's tool-call syntax when it takes tools (ChatTemplate.tool_family), else None."""
        return self.tokenizer.tool_family

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        bad = next((t for t in token_ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise InvalidParamError(f"tokens must be in [0, {self.info.vocab_size}), got {bad}", "tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> ClusterStream:
        """Check, tokenize and send a request now (InvalidParamError at once for bad input)."""
        return self.add_prepared(self.prepare_request(prompt, params, request_id))

    def prepare_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> EngineRequest:
        """Tokenize and check (any thread: the HTTP server does it off its event loop)."""
        return prepare_request(request_id, prompt, params, self.tokenizer, self.info.vocab_size,
                               self.info.max_seq_len)

    def add_prepared(self, prepared: EngineRequest) -> ClusterStream:
        """Send a prepared request to its replica (on the event loop)."""
        request_id = prepared.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = prepared.prompt_token_ids
        # the blocks a replica can have cached: match_prefix always leaves the last token to compute
        hashes = prompt_block_hashes(ids, self.info.block_size, (len(ids) - 1) // self.info.block_size)
        request = ReplicaRequest(request_id, ids, prepared.params, tuple(hashes))
        kv: Any = None
        if self._prefill is not None:
            kv = self._prefill.prefill.remote(request)  # resolved on the decode replica, from the object store
        streaming = self._engine.options(stream=True)
        response = cast(DeploymentResponseGenerator[Any], streaming.generate.remote(request, kv))
        stream = ClusterStream(self, request_id, response)
        self._streams[request_id] = stream
        self._unstarted.add(request_id)
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()

    async def shutdown(self) -> None:
        for stream in list(self._streams.values()):
            stream.close()
        if self._refreshing is not None:
            self._refreshing.cancel()

    def _started(self, request_id: str) -> None:
        self._unstarted.discard(request_id)

    def _release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)
