"""kiln serve --pipeline-parallel 2 on a small 4-layer llama (hidden 512, FFN 4096: its weights, 108 MiB, outweigh
the runtime's own allocations), as a subprocess (its own local Ray, gone with it), each stage under a memory cap
the one graph does not fit: a stage actor SIGKILLed while streams run, two micro-batches of each step in
flight. The streams end with an error event and [DONE], their blocks are freed, the runner starts the stage
again (under the cap), and a prompt served before the kill is served identically after it (the prefix cache
forgot the blocks whose K/V died with the stage)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
from kiln.optimize.split_stages import split_engine  # noqa: E402

STREAMS = 4
# Each stage's cap: a stage's load adds ~56 MiB of private memory, the one graph's ~111 MiB. Serving needs room
# beyond the load (the KV pool, Ray's buffers, 8 MiB per thread stack a worker starts later), so ~30 MiB each side.
BUDGET = 86 << 20
SHARED = [(11 * j) % 250 + 9 for j in range(40)]  # two full blocks and more: cached after the first request


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The one-graph engine and its 2-stage split."""
    from helpers import make_tiny_hf_model

    root = tmp_path_factory.mktemp("pipeline-faults")
    model = make_tiny_hf_model(root, family="llama", num_hidden_layers=4, hidden_size=512, intermediate_size=4096,
                               num_attention_heads=8, num_key_value_heads=4)
    build_engine(model, root / "one", BuildOptions(kv_dtype="float32"), progress=lambda _m: None)
    split_engine(root / "one", root / "two", 2)
    return root / "one", root / "two"


def probe(graph: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "kiln.runtime.pipeline.memory", str(graph), "--budget-bytes",
                           str(BUDGET)], capture_output=True, text=True, timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == (0 if result["loaded"] else 1)
    return result


def test_each_stage_loads_under_a_cap_the_one_graph_does_not(engines):
    one, two = engines
    whole = probe(one / "model.onnx")
    assert not whole["loaded"] and "bad_alloc" in whole["error"], whole
    for stage in ("stage0.onnx", "stage1.onnx"):
        result = probe(two / stage)
        assert result["loaded"] and result["data_bytes"] < BUDGET, result


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
        body = {"model": "m", "prompt": self.prompt, "max_tokens": 900, "temperature": 0, "stream": True,
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


def test_a_stage_killed_mid_stream_fails_its_streams_and_is_restarted(engines, tmp_path):
    one, two = engines
    server = Server(two, tmp_path / "server.log", "--pipeline-parallel", "2", "--num-threads", "1",
                    "--served-model-name", "m", "--max-model-len", "1024", "--kv-cache-bytes", str(8 << 20),
                    "--stage-memory-bytes", str(BUDGET), "--pipeline-micro-batches", "2")  # both stages busy
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
            assert 1 <= stream.tokens < 900, stream.tokens  # cut mid-stream, after its first tokens
            error = stream.events[-1]["error"]["message"]
            assert "pipeline stage" in error and "restarted" in error, error
        after = complete(server, SHARED)  # served again, by the restarted stage
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["choices"][0]["finish_reason"] == "length"
        restarted = stage_actor_pids(server.proc.pid)
        assert len(restarted) == 2 and victim not in restarted, (victim, restarted)
        assert server.metric("kiln_kv_cache_blocks_used") == 0
        assert server.metric("kiln_pipeline_stage_restarts_total") == 1
        whole = (one / "model.onnx.data").stat().st_size
        for stage in range(2):  # about its share of the weights, well under the whole
            resident = server.metric(f'kiln_pipeline_stage_resident_bytes{{stage="{stage}"}}')
            assert 0.4 * whole < resident < 0.85 * whole, (stage, resident, whole)
        assert "started again as pid" in server.log_path.read_text()
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-3000:]


def test_a_stage_over_its_cap_fails_to_load_with_the_reason(engines):
    """The cap holds inside the Ray actors: under half a stage's weights, serve stops before binding its port."""
    _, two = engines
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(two), "--pipeline-parallel", "2",
                           "--num-threads", "1", "--max-model-len", "256", "--kv-cache-bytes", str(4 << 20),
                           "--stage-memory-bytes", str(12 << 20)], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "a pipeline stage actor failed to open its stage: kiln.manifest.EngineLoadError: onnxruntime cannot load" \
        in done.stderr and f"bad_alloc) (is --stage-memory-bytes {12 << 20} too small" in done.stderr, \
        done.stderr[-3000:]
