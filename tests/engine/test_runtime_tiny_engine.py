"""The runtime on a real (tiny, random) engine: end-to-end generation vs transformers,
preemption, prefix caching, streaming, load errors, and no torch at serving time."""

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from kiln.manifest import EngineLoadError
from kiln.runtime import LLM, AsyncLLM, RuntimeConfig, SamplingParams
from kiln.runtime.outputs import merge_outputs

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def token_prompts(vocab=300, k=8):
    return [[(17 * i + 5 * j) % (vocab - 10) + 3 for j in range(8 + 9 * i)] for i in range(k)]


@pytest.fixture(scope="module")
def big(tiny_engine):
    return LLM(tiny_engine, RuntimeConfig(kv_cache_bytes=16 << 20))


@pytest.fixture(scope="module")
def reference(big):
    return [o.outputs[0].token_ids for o in big.generate(token_prompts(), GREEDY)]


def test_greedy_matches_transformers(tiny_model_dir, big):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    prompts = token_prompts(k=3)
    outs = big.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ids[0, len(prompt):].tolist()


def test_text_generation_and_chat_match_transformers(tiny_model_dir, big):
    torch = pytest.importorskip("torch")
    from helpers import TINY_EOS_ID
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    out = big.generate("hello world", SamplingParams(temperature=0, max_tokens=8))[0]
    prompt = tokenizer.encode("hello world", add_special_tokens=False)
    assert out.prompt == "hello world" and out.prompt_token_ids == prompt
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=TINY_EOS_ID,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    expected = ids[0, len(prompt):].tolist()
    assert TINY_EOS_ID not in expected and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    chat = big.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    assert chat.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_preemption_with_a_tiny_pool_keeps_outputs(tiny_engine, reference):
    small = LLM(tiny_engine, RuntimeConfig(kv_cache_bytes=14 * 8192, enable_prefix_caching=False, max_model_len=224))
    assert small.engine.runner.num_blocks == 14
    outs = small.generate(token_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0
    small.engine.block_manager.check()


def test_prefix_cache_prefills_only_new_tokens(tiny_engine):
    shared = [(7 * j) % 280 + 5 for j in range(70)]
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]
    llm = LLM(tiny_engine, RuntimeConfig(kv_cache_bytes=8 << 20))
    a = llm.generate([first], GREEDY)[0]
    before = llm.stats().num_prompt_tokens_computed
    b = llm.generate([second], GREEDY)[0]
    assert b.num_cached_tokens == 64  # 4 full blocks of 16
    assert llm.stats().num_prompt_tokens_computed - before == len(second) - 64
    cold = LLM(tiny_engine, RuntimeConfig(kv_cache_bytes=8 << 20, enable_prefix_caching=False))
    assert [o.outputs[0].token_ids for o in cold.generate([first, second], GREEDY)] == \
        [a.outputs[0].token_ids, b.outputs[0].token_ids]


def test_chunked_prefill_matches_whole_prefill(tiny_engine, reference):
    chunked = LLM(tiny_engine, RuntimeConfig(kv_cache_bytes=8 << 20, max_num_tokens=7))
    assert [o.outputs[0].token_ids for o in chunked.generate(token_prompts(), GREEDY)] == reference


def test_async_streaming_on_the_engine(tiny_engine, reference):
    async def main():
        engine = AsyncLLM(tiny_engine, RuntimeConfig(kv_cache_bytes=8 << 20))
        prompts = token_prompts()[:3]
        results = await asyncio.gather(*(
            _collect(engine.generate(p, GREEDY, f"r{i}")) for i, p in enumerate(prompts)
        ))
        await engine.shutdown()
        return results

    results = asyncio.run(main())
    assert [merge_outputs(r).outputs[0].token_ids for r in results] == reference[:3]
    assert all(len(r) > 1 for r in results)


async def _collect(gen):
    return [o async for o in gen]


def test_load_errors_are_one_sentence(tiny_engine, tmp_path):
    broken = tmp_path / "engine"
    shutil.copytree(tiny_engine, broken)
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(EngineLoadError, match="tokenizer.json is corrupted"):
        LLM(broken)
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    manifest["backend"] = "tensorrt"
    other = tmp_path / "trt"
    shutil.copytree(tiny_engine, other)
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineLoadError, match="backend 'tensorrt' is not available"):
        LLM(other)


def test_serving_never_imports_torch(tiny_engine):
    code = textwrap.dedent(f"""
        import sys
        import kiln.runtime
        from kiln.runtime import LLM, AsyncLLM, SamplingParams
        out = LLM({str(tiny_engine)!r}).generate("hi", SamplingParams(max_tokens=4))
        assert out[0].outputs[0].token_ids
        banned = [m for m in sys.modules if m == "torch" or m.startswith(("torch.", "kiln.export",
                  "kiln.calibration", "kiln.optimize", "transformers"))]
        assert not banned, banned
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
