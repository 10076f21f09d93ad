"""Engine, LLM and AsyncLLM over the fake model: outputs, stops, n > 1, preemption, caching, streaming."""

import asyncio
import time

import pytest
from fake_runner import CharTokenizer, make_fake_engine

from kiln.errors import RequestFailedError
from kiln.runtime.async_llm import AsyncLLM
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(k=8):
    return [[(i * 7 + j) % 60 + 1 for j in range(5 + 3 * i)] for i in range(k)]


def llm(num_blocks=256, **kw) -> LLM:
    return LLM(make_fake_engine(num_blocks, **kw))


def test_preemption_leaves_outputs_unchanged_and_frees_everything():
    ref = llm().generate(prompts(), GREEDY)
    small = llm(num_blocks=16, config=RuntimeConfig(enable_prefix_caching=False))
    got = small.generate(prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    small.engine.block_manager.check()


def test_prefix_cache_computes_only_the_new_tokens():
    shared = [(5 * j) % 60 + 1 for j in range(30)]
    first, second = shared + [3, 4, 5], shared + [9, 8]
    engine = llm()
    a = engine.generate([first], GREEDY)[0]
    before = engine.stats().num_prompt_tokens_computed
    b = engine.generate([second], GREEDY)[0]
    assert b.num_cached_tokens == 28  # 7 full blocks of 4
    assert engine.stats().num_prompt_tokens_computed - before == len(second) - 28
    uncached = llm(config=RuntimeConfig(enable_prefix_caching=False)).generate([first, second], GREEDY)
    assert [a.outputs[0].token_ids, b.outputs[0].token_ids] == [o.outputs[0].token_ids for o in uncached]
    assert engine.stats().prefix_cache_hits == 28


def test_n_samples_fork_from_the_prompt():
    engine = llm()
    out = engine.generate([prompts()[3]], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    computed = engine.stats().num_prompt_tokens_computed
    assert computed < 3 * len(prompts()[3])  # the samples share the prompt's full blocks
    sampled = engine.generate([prompts()[3]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    again = llm().generate([prompts()[3]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]
    assert engine.stats().kv_blocks_used == 0


def test_seeded_output_does_not_depend_on_the_batch():
    p = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=12)
    alone = llm().generate([prompts()[2]], p)[0].outputs[0].token_ids
    mixed = llm().generate(prompts(), [SamplingParams(temperature=0.8, max_tokens=9)] * 2 + [p] + [GREEDY] * 5)
    assert mixed[2].outputs[0].token_ids == alone


def test_finish_reasons():
    engine = llm()
    base = engine.generate([prompts()[1]], GREEDY)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    tok = base.token_ids[4]
    stopped = engine.generate([prompts()[1]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(tok,),
                                                              ignore_eos=True))[0].outputs[0]
    first = base.token_ids.index(tok)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == tok
    assert stopped.token_ids == base.token_ids[: first + 1]
    stop_str = base.text[6:8]
    by_text = engine.generate([prompts()[1]], SamplingParams(temperature=0, max_tokens=20, stop=(stop_str,),
                                                              ignore_eos=True))[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_str
    assert by_text.text == base.text[: base.text.index(stop_str)]
    eos = llm(vocab_size=64).engine
    eos.limits = type(eos.limits)(64, 32, (base.token_ids[2],))
    out = LLM(eos).generate([prompts()[1]], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None and len(out.token_ids) <= 3


def test_max_tokens_none_runs_to_max_seq_len():
    out = llm(max_seq_len=24).generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=None,
                                                                    ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].finish_reason == "length"


def test_bad_input_raises_value_error_naming_it():
    engine = llm(max_seq_len=32)
    too_long = r"prompt \(30 tokens\) \+ max_tokens \(16\) exceeds max_seq_len \(32\)"
    with pytest.raises(ValueError, match=too_long) as err:
        engine.generate([[1] * 30], SamplingParams(max_tokens=16))
    assert err.value.param == "max_tokens"  # the prompt fits: max_tokens is what to lower
    with pytest.raises(ValueError, match=r"prompt \(32 tokens\) \+ max_tokens \(1\)") as err:
        engine.generate([[1] * 32], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"  # no max_tokens would fit
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.generate([[1, 999]], GREEDY)
    with pytest.raises(ValueError, match="params has 1 entries"):
        engine.generate([[1], [2]], [GREEDY])
    assert not engine.engine.has_unfinished()


def test_abort_frees_blocks_and_reports():
    engine = make_fake_engine(64)
    engine.add_request("a", prompts()[4], GREEDY)
    engine.add_request("b", prompts()[5], GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.abort("b")
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    assert engine.abort("missing") is None


def test_logprobs_in_outputs():
    out = llm().generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3 and all(len(d) in (2, 3) for d in out.logprobs)
    first = out.logprobs[0][out.token_ids[0]]
    assert first.rank == 1 and first.decoded_token == out.text[0]
    chosen = zip(out.logprobs, out.token_ids, strict=True)
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in chosen))


def test_engine_leaves_logprob_text_to_the_caller_and_async_fills_it():
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    engine = make_fake_engine(64)
    engine.add_request("a", [1, 2, 3], params)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    steps = [step for d in deltas for step in d.outputs[0].logprobs]
    assert len(steps) == 4 and all(lp.decoded_token is None for step in steps for lp in step.values())

    async def main():
        llm = AsyncLLM(make_fake_engine(64))
        outs = [o async for o in llm.generate([1, 2, 3], params, "a")]
        await llm.shutdown()
        return merge_outputs(outs).outputs[0]

    out = asyncio.run(main())
    assert out.token_ids == merge_outputs(deltas).outputs[0].token_ids
    for token, step in zip(out.token_ids, out.logprobs, strict=True):
        assert len(step) in (3, 4) and step[token].decoded_token == CharTokenizer().decode([token])
        assert all(lp.decoded_token == CharTokenizer().decode([t]) for t, lp in step.items())


def test_llm_takes_an_engine_or_a_dir_not_both():
    with pytest.raises(ValueError, match="config must be None"):
        LLM(make_fake_engine(8), RuntimeConfig())


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.encoded: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(text)
        return super().encode(text, add_special_tokens)


def test_each_prompt_is_tokenized_once_on_both_paths():
    engine = make_fake_engine(64, vocab_size=96)
    engine.tokenizer = CountingTokenizer()
    LLM(engine).generate(["hello", "world"], GREEDY)
    assert engine.tokenizer.encoded == ["hello", "world"]

    async def main():
        llm = AsyncLLM(engine)
        [o async for o in llm.generate("again", GREEDY, "a")]
        await llm.shutdown()

    asyncio.run(main())
    assert engine.tokenizer.encoded == ["hello", "world", "again"]


def test_chat_and_text_prompts():
    engine = llm(vocab_size=96)
    a = engine.chat([{"role": "user", "content": "hi"}], GREEDY)
    b = engine.generate("user:hi;assistant:", GREEDY)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].prompt == "user:hi;assistant:"


# -- AsyncLLM ---------------------------------------------------------------------------------

def test_async_streams_deltas_that_merge_into_llms_output():
    expected = llm().generate(prompts(3), GREEDY)

    async def main():
        engine = AsyncLLM(make_fake_engine(256))
        seen = {}

        async def consume(i, p):
            outs = [o async for o in engine.generate(p, GREEDY, f"r{i}")]
            seen[i] = outs

        await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts(3))))
        await engine.shutdown()
        return seen

    seen = asyncio.run(main())
    for i, outs in seen.items():
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 20  # one new token per step
        merged = merge_outputs(outs).outputs[0]
        assert merged.token_ids == expected[i].outputs[0].token_ids
        assert merged.text == expected[i].outputs[0].text


def test_async_rejects_bad_input_and_aborts():
    async def main():
        fake = make_fake_engine(256, max_seq_len=40)
        fast_execute = fake.runner.execute

        def slow_execute(batch):  # 30 steps take >= 0.3 s, so the abort always lands before the last one
            time.sleep(0.01)
            return fast_execute(batch)

        fake.runner.execute = slow_execute
        engine = AsyncLLM(fake)
        with pytest.raises(ValueError, match="max_seq_len"):
            async for _ in engine.generate([1] * 30, SamplingParams(max_tokens=20), "bad"):
                pass
        slow = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = []
        async for out in engine.generate([1, 2, 3], slow, "x"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("x")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        gen = engine.generate([4, 5, 6], slow, "y")
        await gen.__anext__()
        await gen.aclose()  # a client that goes away
        for _ in range(100):
            if engine.stats().kv_blocks_used == 0 and not engine.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and engine.num_waiting == 0
        assert engine.model_name == "fake" and engine.max_seq_len == 40
        await engine.shutdown()

    asyncio.run(main())


POISON_SEED = 666  # a request the test's sampler cannot sample: it stands for a row whose settings break


def poison_sampler(engine):
    """engine.sampler, raising for any batch holding a row of seed POISON_SEED (as a sampler bug would)."""
    real = engine.sampler

    def sample(rows, seqs):
        if any(s.params.seed == POISON_SEED for s in seqs):
            raise FloatingPointError("cannot sample this row")
        return real(rows, seqs)

    engine.sampler = sample


def test_a_request_whose_sampling_fails_fails_alone():
    params = [GREEDY, SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=20, ignore_eos=True), GREEDY,
              SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)]
    expected = llm().generate([p for i, p in enumerate(prompts(4)) if i != 1], [params[0], params[2], params[3]])
    engine = llm()
    poison_sampler(engine.engine)
    got = engine.generate(prompts(4), params)
    bad = got[1]
    assert bad.finished and bad.error == "FloatingPointError: cannot sample this row"
    assert bad.outputs[0].finish_reason == "abort"
    good = [got[0], got[2], got[3]]
    assert all(o.error is None for o in good)
    assert [[c.token_ids for c in o.outputs] for o in good] == [[c.token_ids for c in o.outputs] for o in expected]
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    engine.engine.block_manager.check()
    assert not engine.engine.requests and not engine.engine._by_seq


def test_async_fails_only_the_request_whose_sampling_failed():
    expected = llm().generate(prompts(3)[::2], GREEDY)

    async def main():
        fake = make_fake_engine(256)
        poison_sampler(fake)
        engine = AsyncLLM(fake)
        bad = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=20)

        async def consume(i, p):
            return [o async for o in engine.generate(p, bad if i == 1 else GREEDY, f"r{i}")]

        results = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts(3))), return_exceptions=True)
        after = [o async for o in engine.generate(prompts(3)[0], GREEDY, "later")]  # the engine keeps serving
        await engine.shutdown()
        return results, after

    results, after = asyncio.run(main())
    assert isinstance(results[1], RequestFailedError) and "cannot sample this row" in str(results[1])
    for outs, ref in zip([results[0], results[2]], expected, strict=True):
        assert merge_outputs(outs).outputs[0].token_ids == ref.outputs[0].token_ids
    assert merge_outputs(after).outputs[0].token_ids == expected[0].outputs[0].token_ids
