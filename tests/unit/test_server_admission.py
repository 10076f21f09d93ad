"""The queue bound under a burst, on the real AsyncLLM, engine and scheduler (over a fake model
whose steps take a while, so no admitted request can finish while the burst is decided)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
from fake_runner import CharTokenizer, FakeModelRunner  # noqa: E402
from server_fake import post_completion_asgi  # noqa: E402

from kiln.runtime.async_llm import AsyncLLM  # noqa: E402
from kiln.runtime.engine import Engine, EngineLimits  # noqa: E402
from kiln.runtime.params import RuntimeConfig  # noqa: E402
from kiln.runtime.server.app import build_app  # noqa: E402

MAX_QUEUE, MAX_NUM_SEQS, BURST = 4, 2, 40
STEP_S, MAX_TOKENS = 0.03, 50  # an admitted request runs >= 1.5 s: longer than any burst takes to decide


class SlowRunner(FakeModelRunner):
    def execute(self, batch):
        time.sleep(STEP_S)
        return super().execute(batch)


def slow_engine() -> tuple[Engine, list[str]]:
    """The engine, and the ids of the requests it has taken (appended on its thread)."""
    limits = EngineLimits(max_seq_len=64, max_num_tokens=32, eos_token_ids=(0,))
    engine = Engine(SlowRunner(128, 4, 64), CharTokenizer(), RuntimeConfig(max_num_seqs=MAX_NUM_SEQS), limits)
    taken: list[str] = []
    add = engine.add

    def counting_add(prepared, *args, **kwargs):
        taken.append(prepared.request_id)
        add(prepared, *args, **kwargs)

    engine.add = counting_add  # type: ignore[method-assign]
    return engine, taken


async def _post(app, body: dict, statuses: list[int], gone: asyncio.Event) -> None:
    """One raw-ASGI request; its status lands in ``statuses``; the client hangs up when ``gone`` is set."""
    def on_message(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await post_completion_asgi(app, body, on_message, gone)


@pytest.mark.parametrize("attempt", range(5))
def test_a_burst_admits_at_most_the_queue_bound_plus_running_capacity(attempt):
    engine, taken = slow_engine()
    llm = AsyncLLM(engine)
    app = build_app(lambda: llm, max_queue=MAX_QUEUE)
    body = {"prompt": "abcdefgh", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}

    async def main() -> tuple[int, int, int]:
        async with app.router.lifespan_context(app):
            statuses: list[int] = []
            gone = asyncio.Event()
            tasks = [asyncio.create_task(_post(app, body, statuses, gone)) for _ in range(BURST)]
            deadline = time.monotonic() + 20
            # every request decided: refused (503) or taken by the engine
            while statuses.count(503) + len(taken) < BURST and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            finished_during_burst = engine.stats().num_generated_tokens >= MAX_TOKENS
            gone.set()  # every client hangs up: the admitted requests are aborted
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
            return statuses.count(503), len(taken), finished_during_burst

    refused, admitted, finished_during_burst = asyncio.run(main())
    assert not finished_during_burst, "a request finished before the burst was decided: the check proves nothing"
    assert refused + admitted == BURST
    assert admitted <= MAX_QUEUE + MAX_NUM_SEQS, f"admitted {admitted} of {BURST}"
    assert admitted >= MAX_QUEUE  # the bound is the queue's length, not less
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_num_waiting_counts_a_request_from_add_request_on():
    engine, _ = slow_engine()
    llm = AsyncLLM(engine)
    from kiln.runtime.params import SamplingParams

    async def main() -> list[int]:
        counts = []
        streams = []
        for i in range(6):
            streams.append(llm.add_request("abc", SamplingParams(max_tokens=2), f"r{i}"))
            counts.append(llm.num_waiting)
        for stream in streams:
            stream.close()
        await llm.shutdown()
        return counts

    counts = asyncio.run(main())
    # the engine thread may start some between two calls (at most max_num_seqs), never lose one
    assert all(c >= i + 1 - MAX_NUM_SEQS for i, c in enumerate(counts)), counts
    assert counts[0] >= 1


def test_max_queue_must_be_positive():
    from kiln.errors import InvalidParamError

    with pytest.raises(InvalidParamError, match=r"^max_queue must be >= 1 \(omit it for no bound\), got 0$"):
        build_app(lambda: None, max_queue=0)


def test_a_batch_larger_than_the_queue_bound_is_a_400():
    engine, taken = slow_engine()
    llm = AsyncLLM(engine)
    from fastapi.testclient import TestClient

    with TestClient(build_app(lambda: llm, max_queue=2)) as client:
        r = client.post("/v1/completions", json={"prompt": ["ab", "cd", "ef"], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "queue bound (2)" in r.json()["error"]["message"]
    assert not taken
