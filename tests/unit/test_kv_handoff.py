"""KV handoff between two engines (disaggregated prefill/decode) over the fake model, whose pool holds the
tokens themselves and whose logits read the whole context back through the block table: a block written
to the wrong place, or a token recomputed differently, changes the output."""

import asyncio
import dataclasses

import numpy as np
import pytest
from fake_runner import make_fake_engine

from kiln.errors import InvalidParamError
from kiln.runtime.async_llm import AsyncLLM
from kiln.runtime.engine import Engine
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import RequestOutput, merge_outputs
from kiln.runtime.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(k=6):
    return [[(i * 5 + j * 3) % 60 + 1 for j in range(6 + 5 * i)] for i in range(k)]


def run(engine: Engine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.block_manager.check()
    return outputs


def prefill(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams):
    first = dataclasses.replace(params, max_tokens=1, n=1)
    engine.add(engine.prepare(request_id, prompt, first), export_kv=True)
    (out,) = [o for o in run(engine) if o.request_id == request_id]
    assert out.finished and out.kv_handoff is not None
    return out.kv_handoff


def decode(engine: Engine, handoffs, params: SamplingParams) -> dict[str, RequestOutput]:
    for request_id, prompt, kv in handoffs:
        engine.add(engine.prepare(request_id, prompt, params), kv=kv)
    deltas: dict[str, list[RequestOutput]] = {}
    for out in run(engine):
        deltas.setdefault(out.request_id, []).append(out)
    return {request_id: merge_outputs(d) for request_id, d in deltas.items()}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0, max_tokens=9, n=3, logprobs=2)])
def test_decoding_from_a_handoff_matches_one_engine_and_frees_both_pools(params):
    ps = prompts()
    one = LLM(make_fake_engine(256))
    reference = one.generate(ps, params)
    prefill_engine, decode_engine = make_fake_engine(64), make_fake_engine(64)
    handoffs = [(f"r{i}", p, prefill(prefill_engine, f"r{i}", p, params)) for i, p in enumerate(ps)]
    got = decode(decode_engine, handoffs, params)
    for i, ref in enumerate(reference):
        out = got[f"r{i}"]
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        assert [o.text for o in out.outputs] == [o.text for o in ref.outputs]
        if params.logprobs is not None:
            assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob)
    for engine in (prefill_engine, decode_engine):
        assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    # the decode engine ran no prompt token but those one engine runs besides the prompts (n > 1: the other
    # samples recompute the partial tail block when they fork)
    recomputed = one.stats().num_prompt_tokens_computed - sum(map(len, ps))
    assert decode_engine.stats().num_prompt_tokens_computed == recomputed


def test_handoffs_wait_for_blocks_and_share_the_decode_sides_prefix_cache():
    shared = [(7 * j) % 60 + 1 for j in range(16)]
    ps = [shared + [i + 1, i + 2, i + 3] for i in range(4)]
    reference = LLM(make_fake_engine(256)).generate(ps, GREEDY)
    prefill_engine = make_fake_engine(64)
    decode_engine = make_fake_engine(12)  # 48 tokens: one 31-token sequence at a time (plus shared blocks)
    handoffs = [(f"r{i}", p, prefill(prefill_engine, f"r{i}", p, GREEDY)) for i, p in enumerate(ps)]
    got = decode(decode_engine, handoffs, GREEDY)
    assert [got[f"r{i}"].outputs[0].token_ids for i in range(4)] == [r.outputs[0].token_ids for r in reference]
    assert decode_engine.block_manager.num_used_blocks == 0


def test_a_handoff_that_ends_at_its_first_token_finishes_at_once():
    p = prompts(1)[0]
    kv = prefill(make_fake_engine(64), "r", p, GREEDY)
    decode_engine = make_fake_engine(64)
    out = decode(decode_engine, [("r", p, kv)], dataclasses.replace(GREEDY, max_tokens=1))["r"]
    assert out.outputs[0].token_ids == [kv.first_token] and out.outputs[0].finish_reason == "length"
    assert decode_engine.block_manager.num_used_blocks == 0


def test_a_handoff_for_another_prompt_or_engine_is_refused():
    p = prompts(1)[0]
    kv = prefill(make_fake_engine(64), "r", p, GREEDY)
    engine = make_fake_engine(64)
    with pytest.raises(InvalidParamError, match="another prompt"):
        engine.add(engine.prepare("x", p + [1], GREEDY), kv=kv)
    with pytest.raises(InvalidParamError, match="do not serve the same engine"):
        other = make_fake_engine(64, block_size=8)
        other.add(other.prepare("x", p, GREEDY), kv=kv)
    wrong = dataclasses.replace(kv, blocks=kv.blocks.astype(np.int32))
    with pytest.raises(InvalidParamError, match="do not serve the same engine"):
        engine.add(engine.prepare("y", p, GREEDY), kv=wrong)
    assert not engine.requests


def test_async_prefill_then_decode():
    p = prompts(2)[1]
    reference = LLM(make_fake_engine(256)).generate([p], GREEDY)[0]

    async def main():
        prefill_llm, decode_llm = AsyncLLM(make_fake_engine(64)), AsyncLLM(make_fake_engine(64))
        try:
            kv = await prefill_llm.prefill(p, GREEDY, "r")
            deltas = [out async for out in decode_llm.add_request(p, GREEDY, "r", kv=kv)]
            return merge_outputs(deltas), prefill_llm.stats(), decode_llm.stats()
        finally:
            await prefill_llm.shutdown()
            await decode_llm.shutdown()

    out, prefill_stats, decode_stats = asyncio.run(main())
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert prefill_stats.kv_blocks_used == decode_stats.kv_blocks_used == 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0, max_tokens=9, n=3)])
def test_a_sliding_window_handoff_sends_and_writes_only_the_window(params):
    """Prompts of 6-31 tokens through a window of 7 in 4-token chunks: the prefill side has released the blocks
    behind the window before it exports (they go as zeros), the decode side gives them no block and writes none,
    and the outputs equal one engine's that releases nothing."""
    from fake_runner import make_windowed_fake_engine

    ps = prompts()
    reference = LLM(make_windowed_fake_engine(256, 7, release=False)).generate(ps, params)
    prefill_engine = make_windowed_fake_engine(64, 7, max_num_tokens=4)
    decode_engine = make_windowed_fake_engine(64, 7)
    written: list[int] = []
    write = decode_engine.runner.write_kv_blocks
    decode_engine.runner.write_kv_blocks = lambda ids, blocks: (written.extend(ids), write(ids, blocks))[1]
    handoffs = [(f"r{i}", p, prefill(prefill_engine, f"r{i}", p, params)) for i, p in enumerate(ps)]
    assert not handoffs[-1][2].blocks[0, 0].any()  # the 31-token prompt's first block: released, sent as zeros
    got = decode(decode_engine, handoffs, params)
    for i, ref in enumerate(reference):
        assert [o.token_ids for o in got[f"r{i}"].outputs] == [o.token_ids for o in ref.outputs], i
    assert len(written) < sum(-(-len(p) // 4) for p in ps)  # the blocks behind each window were never written
