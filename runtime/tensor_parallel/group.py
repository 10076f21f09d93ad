"""The rank processes of a tensor-parallel engine, driven from the engine's process (RankGroup).

Each rank is a process of its own (`python -m kiln.runtime.tensor_parallel`, started with subprocess, so the
engine's own script is not imported again as multiprocessing's spawn would), pinned to its own CPUs (NUMA nodes'
CPUs kept together where there are several), running its ORT session with num_threads threads (1 by default). A step
sends the BatchInput's feeds to every rank over its socket (a pidfd watches its process); the ranks run the step
together, meeting in every kiln.AllReduce through the workspace (a file in /dev/shm that every rank maps; its name
is unlinked once they have), and every rank answers; rank 0's answer carries the logits.

Nothing waits forever: the driver watches every rank's pipe and process sentinel. A rank whose step raised has
the workspace's abort word set so that the others' all-reduce fails at once instead of at its timeout; the group's
counters are then reset and the step raises (its requests fail, the pools are intact). A rank whose process died
has the abort word set too; every rank is stopped and the group started again with a new workspace, and the step
raises KvLostError: no block the engine's BlockManager holds has its K/V on the new ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from kiln import all_reduce
from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError
from kiln.runtime.model_runner import BatchInput, KvLostError
from kiln.runtime.tensor_parallel.rank import RankReply, RankSizing
from kiln.tensor_parallel import TensorRank

log = logging.getLogger("kiln.tensor_parallel")

ALL_REDUCE_TIMEOUT_MS = 60_000  # a rank stuck this long outside the all-reduce fails the step (not a hang)
_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class GroupSizing:
    """How every rank of one group opens: the engine, its ranks, the one graph's pool layout (each rank's pools
    keep its own KV heads), blocks per pool, threads per rank, the step's largest token count."""

    engine_dir: Path
    ranks: tuple[TensorRank, ...]
    pools: KvPoolSpec
    num_blocks: int
    num_threads: int
    max_tokens: int
    hidden_size: int


def numa_cpus() -> list[int]:
    """The CPUs this process may run on, ordered node by node (so contiguous shares stay on one node)."""
    allowed = os.sched_getaffinity(0)
    ordered: list[int] = []
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    for node in nodes:
        try:
            ordered += [c for c in _parse_cpulist((node / "cpulist").read_text()) if c in allowed and c not in ordered]
        except OSError:
            continue
    return ordered + sorted(allowed - set(ordered))


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus += range(int(low), int(high or low) + 1)
    return cpus


def rank_cpus(num_ranks: int, cpus: list[int]) -> list[tuple[int, ...]]:
    """Each rank's CPUs: contiguous equal shares of `cpus` (at least one each; with fewer CPUs than ranks, ranks
    share them in turn)."""
    if len(cpus) < num_ranks:
        return [(cpus[r % len(cpus)],) for r in range(num_ranks)]
    share = len(cpus) // num_ranks
    return [tuple(cpus[r * share:(r + 1) * share]) for r in range(num_ranks)]


def _has_data(conn: Connection) -> bool:
    try:
        return conn.poll()
    except OSError:
        return False


class _Workspace:
    """The group's shared segment: a file in /dev/shm (the temp dir where there is none), mapped here to read the
    ranks' statistics and set the abort word."""

    def __init__(self, sizing: GroupSizing) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = Path(folder) / f"kiln-tp-{os.getpid()}-{secrets.token_hex(4)}"
        size = all_reduce.workspace_bytes(len(sizing.ranks), sizing.max_tokens * sizing.hidden_size)
        with open(self.path, "wb") as f:
            f.truncate(size)
        self.world = len(sizing.ranks)
        self.buffer = np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r+"))
        self.reset()

    def reset(self) -> None:
        """A fresh header: call counters at zero, no abort (every rank idle)."""
        all_reduce.init_workspace(self.buffer, self.world, ALL_REDUCE_TIMEOUT_MS)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class RankGroup:
    """The rank processes; `step` runs one batch on all of them and returns rank 0's reply."""

    def __init__(self, sizing: GroupSizing) -> None:
        self.sizing = sizing
        self.cpus = rank_cpus(len(sizing.ranks), numa_cpus())
        self.restarts = 0
        self.seconds = [0.0] * len(sizing.ranks)  # each rank's seconds in the last step
        self.closed_stats = [{"wait_ns": 0, "bytes": 0} for _ in sizing.ranks]  # of workspaces before a restart
        self._start()

    def _start(self) -> None:
        sizing = self.sizing
        self.workspace = _Workspace(sizing)
        self.conns: list[Connection] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.sentinels: list[int] = []  # a pidfd per rank: readable once its process has exited
        try:
            for index, rank in enumerate(sizing.ranks):
                pools = replace(sizing.pools, num_kv_heads=rank.end_kv_head - rank.first_kv_head)
                rank_sizing = RankSizing(sizing.engine_dir, rank, index, pools, sizing.num_blocks, sizing.num_threads,
                                         self.cpus[index], self.workspace.path)
                ours, theirs = multiprocessing.Pipe()  # a socketpair; the rank inherits its end
                process = subprocess.Popen([sys.executable, "-m", "kiln.runtime.tensor_parallel",
                                            str(theirs.fileno())], pass_fds=[theirs.fileno()])
                theirs.close()
                self.conns.append(ours)
                self.processes.append(process)
                self.sentinels.append(os.pidfd_open(process.pid))
                ours.send(rank_sizing)
            ready = [self._await_ready(index) for index in range(len(sizing.ranks))]
            self.pids, self.vocab_size = [pid for pid, _ in ready], ready[0][1]
        except BaseException:
            self._stop()
            raise
        self.workspace.unlink()  # every rank has it mapped: no file left behind, whatever happens next

    def _await_ready(self, index: int) -> tuple[int, int]:
        conn, process, sentinel = self.conns[index], self.processes[index], self.sentinels[index]
        ready = wait([conn, sentinel], timeout=_START_TIMEOUT_S)
        if conn in ready:
            try:
                kind, value = conn.recv()
            except EOFError:
                kind, value = "failed", "its process exited"
            if kind == "ready":
                return int(value[0]), int(value[1])
            raise EngineLoadError(f"tensor-parallel rank {index} failed to open its graph: {value}")
        why = "exited" if sentinel in ready else f"did not start within {_START_TIMEOUT_S:.0f} s"
        raise EngineLoadError(f"tensor-parallel rank {index} {why} before opening its graph "
                              f"(exit code {process.poll()})")

    def step(self, batch: BatchInput) -> RankReply:
        """Every rank's run of batch; rank 0's reply (with the logits), each rank's seconds in `seconds`."""
        feeds = batch.feeds()
        replies: dict[int, RankReply] = {}
        dead: list[int] = []
        for index, conn in enumerate(self.conns):
            try:
                conn.send(feeds)
            except OSError:  # its process is gone (a broken pipe)
                dead.append(index)
        if dead:
            all_reduce.set_abort(self.workspace.buffer)
        pending = set(range(len(self.conns))) - set(dead)
        while pending:
            waitables: dict[Any, int] = {self.conns[i]: i for i in pending} | {self.sentinels[i]: i for i in pending}
            for ready in wait(list(waitables)):
                index = waitables[ready]
                if index not in pending:
                    continue
                if ready is self.conns[index]:
                    try:
                        replies[index] = self.conns[index].recv()
                    except (EOFError, OSError):  # closed or reset: its process is gone
                        dead.append(index)
                elif not _has_data(self.conns[index]):
                    dead.append(index)
                else:
                    continue  # its reply came just before it exited: read it next time round
                pending.discard(index)
                if index in dead or replies[index].error is not None:
                    all_reduce.set_abort(self.workspace.buffer)  # the others' waits end now
        self.seconds = [replies[i].seconds if i in replies else 0.0 for i in range(len(self.conns))]
        if dead:
            raise self._restart(dead)
        errors = [(i, r.error) for i, r in sorted(replies.items()) if r.error is not None]
        if errors:
            self._keep_stats()
            self.workspace.reset()  # every rank is idle again: counters from zero, no abort
            cause = next(((i, e) for i, e in errors if "aborted" not in e), errors[0])
            raise RuntimeError(f"tensor-parallel rank {cause[0]} failed the step: {cause[1]}")
        return replies[0]

    def _restart(self, dead: list[int]) -> KvLostError:
        pids = [self.pids[i] for i in dead]
        self._keep_stats()
        self._stop()
        self.restarts += 1
        self._start()
        log.warning("tensor-parallel rank(s) %s (pid %s) died; every rank was started again (pids %s)", dead, pids,
                    self.pids)
        ranks = ", ".join(f"{i} (pid {p})" for i, p in zip(dead, pids, strict=True))
        return KvLostError(f"tensor-parallel rank {ranks} died; the ranks were started again and the K/V of the "
                           "running requests is lost")

    def rank_stats(self) -> list[dict[str, int]]:
        """Each rank's all-reduce wait (ns) and bytes reduced since the group first started."""
        now = [all_reduce.rank_stats(self.workspace.buffer, r) for r in range(len(self.conns))]
        return [{"wait_ns": c["wait_ns"] + n["wait_ns"], "bytes": c["bytes"] + n["bytes"]}
                for c, n in zip(self.closed_stats, now, strict=True)]

    def _keep_stats(self) -> None:
        self.closed_stats = self.rank_stats()

    def _stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for conn in self.conns:
            conn.close()
        for sentinel in self.sentinels:
            os.close(sentinel)
        self.sentinels = []
        self.workspace.unlink()

    def close(self) -> None:
        self._stop()
