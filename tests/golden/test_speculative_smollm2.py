"""Speculative decoding on SmolLM2-135M (fp32 engine): greedy output with the n-gram proposer and with an
int4-q4_1 draft of the same checkpoint is token-identical to the same engine without speculation, over
32 input-grounded prompts submitted at staggered steps - with a roomy pool and prefix caching on
(a shared system prompt), and with a pool too small for all of them (preemptions).

A divergence is accepted only where plain decoding's own top-2 logprobs are within TIE_GAP (a verified
row is computed in a different batch shape than a plain decode, and fp32 summation order may flip an
exact near-tie); anything else fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.runtime import RuntimeConfig, SamplingParams
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.outputs import merge_outputs
from kiln.runtime.params import SpeculativeConfig

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
MAX_MODEL_LEN = 256  # prompts of ~60-130 tokens + NEW_TOKENS: lets the small pools hold one whole sequence
TIE_GAP = 1e-3
SYSTEM = ("You are a careful assistant. When asked to repeat, quote or edit a text, you reproduce it exactly, "
          "changing only what you are asked to change.")
PASSAGES = [
    "The river rose in the night and by morning the lower fields were under water.",
    "def area(width, height):\n    return width * height\n",
    "Rain fell on the old stone bridge while the market closed its stalls one by one.",
    "for i in range(10):\n    print(i * i)\n",
    "The committee met on Tuesday and agreed to postpone the vote until the spring.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "She packed a lantern, a map of the coast and three days of bread.",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\n",
]
ASKS = ["Repeat this exactly:", "Quote this text:", "Copy this and add a comment at the end:", "Rewrite this:"]


def _prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(32):
        text = f"{ASKS[i % len(ASKS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        if i % 3 == 0:
            text += "\n" + PASSAGES[(i + 3) % len(PASSAGES)]
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        out.append(tok.encode(tok.apply_chat_template(chat)))
    return out


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit one prompt every other step; check the block manager(s) after each step."""
    deltas: dict[str, list] = {}
    finals: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                finals[out.request_id] = merge_outputs(deltas.pop(out.request_id)).outputs[0].token_ids
        engine.block_manager.check()
        draft_bm = getattr(engine.proposer, "block_manager", None)
        if draft_bm is not None:
            draft_bm.check()
        steps += 1
    assert engine.block_manager.num_used_blocks == 0
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(smollm2_engine: Path):
    """Plain decoding's tokens and top-2 logprobs per position, and the prompts."""
    engine = load_engine(smollm2_engine, RuntimeConfig(kv_cache_bytes=256 << 20, max_model_len=MAX_MODEL_LEN))
    prompts = _prompts(engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    deltas: dict[str, list] = {}
    results = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                results[out.request_id] = merge_outputs(deltas.pop(out.request_id)).outputs[0]
    outputs = [results[str(i)] for i in range(len(prompts))]
    return prompts, outputs


def _assert_same(got: list[list[int]], reference) -> None:
    _, outputs = reference
    for i, (tokens, want) in enumerate(zip(got, outputs, strict=True)):
        if tokens == want.token_ids:
            continue
        at = next(j for j, (a, b) in enumerate(zip(tokens, want.token_ids, strict=False)) if a != b)
        top = sorted((lp.logprob for lp in want.logprobs[at].values()), reverse=True)
        assert top[0] - top[1] < TIE_GAP, f"prompt {i}: differs at token {at} where plain decoding has no near-tie"


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", num_tokens=4)


@pytest.mark.parametrize("kv_bytes", [256 << 20, 12 << 20], ids=["roomy", "small-pool"])
def test_ngram_greedy_matches_plain_decoding(smollm2_engine, reference, kv_bytes):
    engine = load_engine(smollm2_engine, RuntimeConfig(kv_cache_bytes=kv_bytes, max_model_len=MAX_MODEL_LEN,
                                                       speculative=NGRAM))
    got = _run(engine, reference[0], GREEDY)
    _assert_same(got, reference)
    stats = engine.stats()
    assert stats.spec_acceptance_rate is not None and stats.spec_acceptance_rate > 0.3
    assert stats.prefix_cache_hits > 0
    if kv_bytes < 100 << 20:
        assert stats.num_preemptions > 0


def test_draft_greedy_matches_plain_decoding(smollm2_engine, smollm2_q4_1_engine, reference):
    spec = SpeculativeConfig("draft", num_tokens=3, draft_engine=str(smollm2_q4_1_engine))
    engine = load_engine(smollm2_engine, RuntimeConfig(kv_cache_bytes=24 << 20, max_model_len=MAX_MODEL_LEN,
                                                       speculative=spec))
    got = _run(engine, reference[0], GREEDY)
    _assert_same(got, reference)
    stats = engine.stats()
    assert stats.spec_acceptance_rate is not None and stats.spec_acceptance_rate > 0.5
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
