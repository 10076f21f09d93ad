"""The engine replica of `kiln serve --replicas`: one AsyncLLM (its own KV pool and threads) in a Ray Serve
replica actor. launch.py deploys this class (serve.deployment(EngineReplica).options(...)) once as the
engine deployment, and with disaggregation once more as the prefill deployment.

Cancelling a call's response in the ingress cancels its task here, and the AsyncLLM stream's close then
aborts the engine request, so its blocks are freed as when an HTTP client leaves `kiln serve`.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.async_llm import AsyncLLM
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.cluster.protocol import ReplicaInfo, ReplicaRequest
from kiln.runtime.cluster.router import PREFIX_BLOCKS
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.long_lived import freeze_start_up_objects
from kiln.runtime.outputs import EngineStats, RequestOutput
from kiln.runtime.params import RuntimeConfig


@dataclass(frozen=True)
class ReplicaStats:
    replica_id: str
    pid: int  # the replica actor's process (what dies when a replica fails)
    cpu_s: float  # CPU seconds its process has used, all threads (benchmarks/bench_cluster.py)
    stats: EngineStats


class EngineReplica:
    def __init__(self, engine_dir: str | Path, config: RuntimeConfig) -> None:
        self.llm = AsyncLLM(engine_dir, config)
        freeze_start_up_objects()

    def info(self) -> ReplicaInfo:
        engine = self.llm.engine
        return ReplicaInfo(engine.model_name, engine.max_seq_len, engine.runner.vocab_size, engine.runner.block_size)

    async def generate(self, request: ReplicaRequest, kv: KvHandoff | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output deltas; kv: the prompt's KV from a prefill replica (disaggregation)."""
        stream = self.llm.add_request(request.prompt_token_ids, request.params, request.request_id, kv)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def prefill(self, request: ReplicaRequest) -> KvHandoff:
        """The prompt's KV and first token, for a decode replica (they travel through Ray's object store)."""
        return await self.llm.prefill(request.prompt_token_ids, request.params, request.request_id)

    def stats(self) -> ReplicaStats:
        from ray import serve

        return ReplicaStats(serve.get_replica_context().replica_id.unique_id, os.getpid(), time.process_time(),
                            self.llm.stats())

    def record_routing_stats(self) -> dict[str, list[int]]:
        """Polled by the Serve controller every request_routing_stats_period_s; read by router.py."""
        return {PREFIX_BLOCKS: cached_block_hashes(self.llm.engine.block_manager)}

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread ended is replaced."""
        if not self.llm.engine_thread_alive:
            raise RuntimeError("the engine thread of this replica has stopped")


def cached_block_hashes(block_manager: BlockManager) -> list[int]:
    """The hashes the prefix cache can serve now. Read from another thread than the engine's: list() of a
    dict is one C call under the GIL, and a resize racing it only costs a retry."""
    for _ in range(3):
        try:
            return list(block_manager.hash_to_block)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return []
