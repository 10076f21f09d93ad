"""One tensor-parallel rank: its graph's ONNX Runtime session, its KV pools and the group's workspace, in a process
of its own pinned to its CPUs (rank_main, run by `python -m kiln.runtime.tensor_parallel`), taking steps from
the driver over a socket it inherits.

The rank binds its pools once (kv_cache.{i} and kv_cache_out.{i}, written in place) and the workspace once (the
shared file every rank maps, read and written by kiln.AllReduce), then per step the BatchInput's feeds. Rank 0
returns the step's logits; the others return nothing but their time, having taken part in every all-reduce.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from kiln import all_reduce, contract
from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError
from kiln.runtime.kv_memory import zeroed_pool
from kiln.runtime.model_runner import BatchInput
from kiln.tensor_parallel import TP_HIDDEN, TensorRank


@dataclass(frozen=True)
class RankSizing:
    """How a rank opens: the engine dir, its rank record and index, its pools (its KV heads), blocks per pool,
    ORT threads, the CPUs it is pinned to, and the workspace file."""

    engine_dir: Path
    rank: TensorRank
    index: int
    pools: KvPoolSpec
    num_blocks: int
    num_threads: int
    cpus: tuple[int, ...]
    workspace: Path


@dataclass(frozen=True)
class RankReply:
    """A step's answer: the rank's seconds (bindings and run), rank 0's logits, or the error it raised."""

    seconds: float
    logits: np.ndarray | None = None
    error: str | None = None


class RankRunner:
    """A rank's session with its pools and the workspace bound."""

    def __init__(self, sizing: RankSizing) -> None:
        from kiln.runtime.ort_runner import open_session

        self.session = open_session(sizing.engine_dir / sizing.rank.graph, sizing.num_threads)
        inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        first = contract.LOGITS if sizing.index == 0 else TP_HIDDEN
        if first not in outputs or all_reduce.WORKSPACE_INPUT not in inputs:
            raise EngineLoadError(f"{sizing.rank.graph} is not a tensor-parallel rank {sizing.index} graph (it needs "
                                  f"the output {first} and the input {all_reduce.WORKSPACE_INPUT}); rebuild the engine")
        self.feeds = [name for name in BatchInput.FEEDS if name in inputs]
        self.workspace = np.memmap(sizing.workspace, dtype=np.uint8, mode="r+")
        self.pools = [zeroed_pool(sizing.pools.pool_shape(sizing.num_blocks), sizing.pools.dtype)
                      for _ in range(sizing.pools.num_layers)]
        import onnxruntime as ort

        self._values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools]
        self._workspace_value = ort.OrtValue.ortvalue_from_numpy(np.asarray(self.workspace))
        self.binding = self.session.io_binding()
        self.first = first
        shape = next(o for o in self.session.get_outputs() if o.name == first).shape
        self.output_width = shape[-1] if shape and isinstance(shape[-1], int) else 0  # rank 0's: the vocabulary
        self.binding.bind_output(first, "cpu")  # bound first: get_outputs() returns it first
        for layer, value in enumerate(self._values):
            self.binding.bind_ortvalue_input(contract.kv_cache_input(layer), value)
            self.binding.bind_ortvalue_output(contract.kv_cache_output(layer), value)
        self.binding.bind_ortvalue_input(all_reduce.WORKSPACE_INPUT, self._workspace_value)

    def run(self, feeds: dict[str, np.ndarray]) -> RankReply:
        start = time.perf_counter()
        for name in self.feeds:
            self.binding.bind_cpu_input(name, feeds[name])
        self.binding.bind_output(self.first, "cpu")
        self.session.run_with_iobinding(self.binding)
        logits = self.binding._iobinding.get_outputs()[0].numpy() if self.first == contract.LOGITS else None
        return RankReply(time.perf_counter() - start, logits)


def rank_main(sizing: RankSizing, conn: Connection) -> None:
    """A rank process: pin to its CPUs, open, say ("ready", pid) or ("failed", why), then answer steps (a dict of
    feeds) until None or the pipe closes."""
    try:
        os.sched_setaffinity(0, sizing.cpus)
        runner = RankRunner(sizing)
    except Exception as exc:  # noqa: BLE001 - the driver reports it as the load error
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", (os.getpid(), runner.output_width)))
    while True:
        try:
            feeds = conn.recv()
        except EOFError:
            return
        if feeds is None:
            return
        start = time.perf_counter()
        try:
            reply = runner.run(feeds)
        except Exception as exc:  # noqa: BLE001 - the step fails; the driver decides what it costs
            reply = RankReply(time.perf_counter() - start, error=str(exc) or traceback.format_exc(limit=1))
        conn.send(reply)


def main() -> None:
    """python -m kiln.runtime.tensor_parallel FD: a rank on the connection inherited as file descriptor FD, whose
    first message is its RankSizing (run through __main__.py, so that what it pickles is named by this module)."""
    conn = Connection(int(sys.argv[1]))
    try:
        sizing = conn.recv()
    except EOFError:
        return
    rank_main(sizing, conn)
