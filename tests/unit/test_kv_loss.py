"""A runner whose pools lose their contents mid-run (a pipeline stage restarted: KvLostError), over the fake
model whose pool holds token ids: the requests holding blocks fail with the error and free them, a request
still waiting runs to the tokens it would have had, and the prefix cache no longer offers the wiped blocks
(the fake model asserts on reading an unwritten slot)."""

import numpy as np
from fake_runner import make_fake_engine

from kiln.runtime.model_runner import BatchInput, KvLostError
from kiln.runtime.params import RuntimeConfig, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = [(5 * j) % 60 + 1 for j in range(14)]  # three full 4-token blocks: cached after a first request


def run(engine, requests: dict[str, list[int]], lose_at_step: int | None = None) -> dict[str, tuple[list[int], str]]:
    """Each request's tokens and error ('' if none); the pools wiped and KvLostError raised at step lose_at_step."""
    runner, execute, calls = engine.runner, engine.runner.execute, []

    def losing_execute(batch: BatchInput) -> np.ndarray:
        calls.append(batch)
        if len(calls) == lose_at_step:
            runner.pool[:] = -1
            raise KvLostError("pipeline stage 1 died and was restarted")
        return execute(batch)

    runner.execute = losing_execute
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, PARAMS)
    got: dict[str, tuple[list[int], str]] = {r: ([], "") for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + list(out.outputs[0].token_ids), out.error or "")
        engine.block_manager.check()
    return got


def test_kv_loss_fails_the_requests_holding_blocks_and_keeps_the_waiting_ones():
    config = RuntimeConfig(max_num_seqs=2)  # the third request waits, holding no blocks
    requests = {"a": SHARED + [3], "b": SHARED + [7, 8], "c": [9, 10, 11, 12, 13]}
    want = run(make_fake_engine(64, config=config), dict(requests))
    engine = make_fake_engine(64, config=config)
    got = run(engine, {"warm": SHARED + [40]})  # caches SHARED's blocks
    got = run(engine, requests, lose_at_step=3)
    for request_id in ("a", "b"):
        tokens, error = got[request_id]
        assert "KvLostError: pipeline stage 1 died" in error and 0 < len(tokens) < 12, got[request_id]
    assert got["c"] == want["c"] and not got["c"][1]
    assert engine.stats().kv_blocks_used == 0
    again = run(engine, {"a2": SHARED + [3]})  # its prefix blocks were wiped: computed again, not found cached
    assert again["a2"] == want["a"]
