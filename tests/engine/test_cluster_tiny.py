"""`kiln serve --replicas` on the tiny engine (Ray Serve, local, 1 thread per replica): prefix-affinity routing
against round-robin on a shared-system-prompt workload, a replica killed mid-stream, and disaggregated
prefill/decode against one engine. One Ray session serves the whole module (starting Ray is the slow part)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import pytest

pytest.importorskip("ray")

from kiln.runtime.cluster.launch import ClusterOptions, connect_ray, deploy, undeploy  # noqa: E402
from kiln.runtime.llm import LLM  # noqa: E402
from kiln.runtime.outputs import merge_outputs  # noqa: E402
from kiln.runtime.params import RuntimeConfig, SamplingParams  # noqa: E402

BLOCK = 16
# 36 blocks per replica: 4 running sequences (6 blocks each at most) and a few more cached 4-block system
# prompts: 4 system prompts fit beside them (prefix routing), 8 do not (round-robin)
ROUTING_CONFIG = RuntimeConfig(num_threads=1, max_model_len=256, kv_cache_bytes=36 * 8192, max_num_seqs=4)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session():
    import ray
    from ray import serve

    if ray.is_initialized():
        ray.shutdown()  # a Ray left by another test of this worker may have too few logical CPUs for two apps
    connect_ray(ClusterOptions(replicas=4), ROUTING_CONFIG)  # logical CPUs for two 2-replica apps at once
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def prefix_cluster(ray_session, tiny_engine):
    llm = deploy(tiny_engine, ROUTING_CONFIG, ClusterOptions(replicas=2, routing="prefix"), app="prefix")
    yield llm
    undeploy("prefix")


def system_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(4 * BLOCK)] for _ in range(8)]


async def hit_rate_of_ideal(llm, systems: list[list[int]], tag: str) -> float:
    """8 system prompts x 16 questions, 8 in flight: each system prompt's first question (all 8 at once), then the
    other 120 in random order, measured: prompt tokens served from the replicas' prefix caches / what one cache
    holding every system prompt would serve (4 blocks per request)."""
    gate = asyncio.Semaphore(8)

    async def one(s: int, q: int) -> None:
        question = [(q * 13 + j) % 300 + 1 for j in range(BLOCK)]
        async with gate:
            async for _ in llm.generate(systems[s] + question, SHORT, f"{tag}-{s}-{q}"):
                pass

    await asyncio.gather(*(one(s, 0) for s in range(8)))
    before = await llm.refresh_stats()
    order = [(s, q) for q in range(1, 16) for s in range(8)]
    random.Random(7).shuffle(order)
    await asyncio.gather(*(one(s, q) for s, q in order))
    after = await llm.refresh_stats()
    return (after.prefix_cache_hits - before.prefix_cache_hits) / (len(order) * 4 * BLOCK)


def test_prefix_routing_reaches_the_ideal_hit_rate_and_round_robin_does_not(prefix_cluster, tiny_engine):
    prefix = asyncio.run(hit_rate_of_ideal(prefix_cluster, system_prompts(1), "prefix"))
    llm = deploy(tiny_engine, ROUTING_CONFIG, ClusterOptions(replicas=2, routing="round-robin"), app="rr")
    try:
        round_robin = asyncio.run(hit_rate_of_ideal(llm, system_prompts(2), "rr"))
    finally:
        undeploy("rr")
    print(f"hit rate of the ideal: prefix {prefix:.2f}, round-robin {round_robin:.2f}")
    # the router's bar: prefix >= 0.9 of the ideal (runs here: 0.93-0.97; round-robin 0.6-0.7)
    assert prefix >= 0.9
    assert round_robin <= prefix - 0.15


class AsgiStream:
    """One POST through the ASGI app, its body chunks recorded as the app sends them (httpx's ASGI transport
    returns only once the whole response is done, so a test could not see a stream's first tokens)."""

    def __init__(self, app, path: str, body: dict | None = None) -> None:
        self.app, self.path = app, path
        self.data = b"" if body is None else json.dumps(body).encode()
        self.status = 0
        self.chunks: list[str] = []
        self.first_token = asyncio.Event()
        self._done = asyncio.Event()

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    async def run(self) -> AsgiStream:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST" if self.data else "GET",
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 40000), "server": ("kiln", 80),
                 "headers": [(b"host", b"kiln"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(self.data)).encode())]}
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": self.data, "more_body": False}
            await self._done.wait()  # the client stays connected until the response ends
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body":
                self.chunks.append(message.get("body", b"").decode())
                if '"text"' in self.chunks[-1]:
                    self.first_token.set()
                if not message.get("more_body", False):
                    self._done.set()

        await self.app(scope, receive, send)
        self._done.set()
        return self

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.text.splitlines() if line.startswith("data: {")]


async def kill_a_replica_mid_stream(llm):
    """One round of the failover test through the HTTP app (see the test)."""
    from kiln.runtime.server.app import build_app

    app = build_app(lambda: llm)
    max_tokens = 200  # 32 + 200 tokens: a few hundred engine steps, far longer than a kill takes

    def body(i: int, **kw) -> dict:  # distinct prompts: no shared prefix pulls the streams to one replica
        return {"prompt": [(i * 7 + j) % 300 + 1 for j in range(32)], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, **kw}

    async with app.router.lifespan_context(app):
        pids = {s.pid for s in await llm.replica_stats()}
        assert len(pids) == 2
        streams = [AsgiStream(app, "/v1/completions", body(i)) for i in range(12)]
        load = [asyncio.create_task(s.run()) for s in streams]
        deadline = time.monotonic() + 60
        while sum(s.first_token.is_set() for s in streams) < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        busiest = max(await llm.replica_stats(), key=lambda r: r.stats.num_running)
        os.kill(busiest.pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*load), 120)
        after = [await AsgiStream(app, "/v1/completions", body(100 + i, max_tokens=4)).run() for i in range(4)]
        plain = await AsgiStream(app, "/v1/completions", body(200, max_tokens=4, stream=False)).run()
        deadline = time.monotonic() + 60
        while True:  # the replica comes back: two live replicas, one of them new
            alive = {s.pid for s in await llm.replica_stats()}
            if len(alive) == 2 and busiest.pid not in alive or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        await llm.refresh_stats()  # a scrape reads the last refresh (it never waits on the replicas)
        metrics = await AsgiStream(app, "/metrics").run()
        return streams, busiest.stats.num_running, after, plain, alive, busiest.pid, metrics.text


def test_a_replica_killed_mid_stream(ray_session, tiny_engine):
    """12 long streams, 8 of them running (4 per replica): once several have their first tokens (seen through
    the HTTP app), the replica running the most is killed. Its streams end with an error event and [DONE]
    after the tokens they had, the others finish; requests sent meanwhile are answered; Serve brings the
    replica back; /metrics sums the replicas.

    The replicas run ahead of this process's reading, and a stall here (seen: 4 s for one stats call on a
    cluster that had already lost a replica) lets the victim finish its streams before the kill, which tests
    nothing: each round gets freshly deployed replicas, and a round in which no stream was cut is sent again."""
    for attempt in range(2):
        llm = deploy(tiny_engine, ROUTING_CONFIG, ClusterOptions(replicas=2, routing="prefix"), app=f"kill{attempt}")
        try:
            streams, running_on_victim, after, plain, alive, victim, metrics = asyncio.run(
                kill_a_replica_mid_stream(llm))
        finally:
            undeploy(f"kill{attempt}")
        cut = cut_mid_stream = finished = 0
        for s in streams:
            if s.status == 500:  # queued on the killed replica: it failed before the stream began
                assert "failed before it finished" in json.loads(s.text)["error"]["message"], s.text
                cut += 1
                continue
            assert s.status == 200 and s.text.rstrip().endswith("data: [DONE]"), s.text[-300:]
            events = s.events()
            if "error" in events[-1]:
                assert "failed before it finished" in events[-1]["error"]["message"], events[-1]
                cut += 1
                cut_mid_stream += len(events) > 1  # tokens before the error (a queued stream has none)
            else:
                assert events[-1]["choices"][0]["finish_reason"] == "length"
                finished += 1
        print(f"round {attempt}: killed a replica running {running_on_victim}: {cut} cut "
              f"({cut_mid_stream} mid-stream), {finished} finished")
        assert cut + finished == 12  # every stream ended, cut or complete
        assert all(a.status == 200 and a.text.rstrip().endswith("data: [DONE]") and "error" not in a.events()[-1]
                   for a in after)
        assert plain.status == 200 and json.loads(plain.text)["choices"][0]["finish_reason"] == "length"
        assert len(alive) == 2 and victim not in alive
        assert "kiln_kv_cache_blocks_total 72.0" in metrics  # 2 x 36 blocks
        if cut_mid_stream >= 1:
            break
    # the killed replica was running streams: they were cut mid-stream, and every other stream completed
    assert cut_mid_stream >= 1 and finished >= 1, (running_on_victim, cut, cut_mid_stream, finished)


def test_disaggregated_greedy_output_is_one_engines_and_frees_both_pools(ray_session, tiny_engine):
    config = RuntimeConfig(num_threads=1, max_model_len=256, kv_cache_bytes=64 * 8192)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (5, 16, 17, 40, 64, 90)]
    params = SamplingParams(temperature=0, max_tokens=24)
    reference = LLM(tiny_engine, config).generate(prompts, params)
    llm = deploy(tiny_engine, config, ClusterOptions(replicas=1, prefill_replicas=1), app="disagg")
    try:
        async def main():
            outs = await asyncio.gather(*(_collect(llm, p, params, f"d{i}") for i, p in enumerate(prompts)))
            return outs, await llm.replica_stats("engine"), await llm.replica_stats("prefill")

        outs, decode_side, prefill_side = asyncio.run(main())
    finally:
        undeploy("disagg")
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert [o.outputs[0].text for o in outs] == [r.outputs[0].text for r in reference]
    for side in (decode_side, prefill_side):
        assert len(side) == 1 and side[0].stats.kv_blocks_used == 0 and side[0].stats.num_running == 0
    # the decode replica computed no prompt token; the prefill replica computed them all, and one token each
    assert decode_side[0].stats.num_prompt_tokens_computed == 0
    assert prefill_side[0].stats.num_generated_tokens == len(prompts)


async def _collect(llm, prompt, params, request_id):
    return merge_outputs([out async for out in llm.generate(prompt, params, request_id)])

