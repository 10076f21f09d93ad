"""kiln serve --pipeline-parallel 2 on a tiny 4-layer llama, as a subprocess (its own local Ray, gone with it):
a stage actor SIGKILLed while streams run. The streams end with an error event and [DONE], their blocks are
freed, the runner starts the stage again, and a prompt served before the kill is served identically after it
(the prefix cache forgot the blocks whose K/V died with the stage)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402

from kiln.manifest import BuildOptions  # noqa: E402
from kiln.optimize.build import build_engine  # noqa: E402

STREAMS = 4
SHARED = [(11 * j) % 250 + 9 for j in range(40)]  # two full blocks and more: cached after the first request


@pytest.fixture(scope="module")
def staged_engine(tmp_path_factory):
    from helpers import make_tiny_hf_model

    root = tmp_path_factory.mktemp("pipeline-faults")
    model = make_tiny_hf_model(root, family="llama", num_hidden_layers=4)
    build_engine(model, root / "engine", BuildOptions(kv_dtype="float32", pipeline_stages=2),
                 progress=lambda _m: None)
    return root / "engine"


def stage_actor_pids(root_pid: int) -> set[int]:
    """The pids of the StageActor processes below root_pid (the server started its Ray, whose raylet starts
    the actors' workers): this server's stages only, whatever other Ray sessions run on the machine."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                if b"StageActor" in (Path("/proc") / str(child) / "cmdline").read_bytes():
                    found.add(child)
            except OSError:
                continue
    return found


class Stream(threading.Thread):
    """One streamed completion read as it arrives: its events (JSON) and whether it ended with [DONE]."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.events: list[dict] = []
        self.done = False
        self.status = 0

    def run(self) -> None:
        body = {"model": "m", "prompt": self.prompt, "max_tokens": 1500, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer none"}) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if "choices" in e)


def complete(server: Server, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60, headers=server.headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_stage_killed_mid_stream_fails_its_streams_and_is_restarted(staged_engine, tmp_path):
    server = Server(staged_engine, tmp_path / "server.log", "--pipeline-parallel", "2", "--num-threads", "1",
                    "--served-model-name", "m", "--max-model-len", "2048", "--kv-cache-bytes", str(8 << 20))
    try:
        before = complete(server, SHARED)
        pids = stage_actor_pids(server.proc.pid)
        assert len(pids) == 2, pids
        streams = [Stream(server.url, SHARED[:20 + i] + [i + 3]) for i in range(STREAMS)]
        for stream in streams:
            stream.start()
        deadline = time.monotonic() + 60
        while not all(s.tokens for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = max(pids)
        os.kill(victim, signal.SIGKILL)
        for stream in streams:
            stream.join(timeout=60)
            assert not stream.is_alive(), "a stream hung after its stage died"
        for stream in streams:
            assert stream.status == 200 and stream.done, (stream.status, stream.events[-1:])
            assert 1 <= stream.tokens < 1500, stream.tokens  # cut mid-stream, after its first tokens
            error = stream.events[-1]["error"]["message"]
            assert "pipeline stage" in error and "restarted" in error, error
        after = complete(server, SHARED)  # served again, by the restarted stage
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["choices"][0]["finish_reason"] == "length"
        restarted = stage_actor_pids(server.proc.pid)
        assert len(restarted) == 2 and victim not in restarted, (victim, restarted)
        assert server.metric("kiln_kv_cache_blocks_used") == 0
        assert server.metric("kiln_pipeline_stage_restarts_total") == 1
        assert "started again as pid" in server.log_path.read_text()
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-3000:]
