"""Structured output over the fake model and a small byte-level tokenizer: the specs' checks, the mask provider
against llguidance itself, the op library's mask kernel against llguidance's numpy reference, and generations
(greedy, sampled, n > 1, preemption, speculation, hypothesis-drawn schemas) that must match their constraint."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from fake_runner import FakeModelRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.numpy import apply_token_bitmask_inplace
from schemas import bounded_schemas
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kiln.errors import InvalidParamError
from kiln.runtime.engine import Engine, EngineLimits
from kiln.runtime.llm import LLM
from kiln.runtime.ops import sampling as kernels
from kiln.runtime.params import RuntimeConfig, SamplingParams, SpeculativeConfig
from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import GrammarCompiler, MaskStep
from kiln.runtime.tokenizer import Tokenizer as EngineTokenizer

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = 2
VOCAB = 320  # the logits' width: past the tokenizer's 261 tokens, as a padded embedding is

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 4},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
}, "required": ["id", "name", "kind", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer: 3 special tokens (EOS 2), the 256 byte symbols, 2 merges."""
    out = tmp_path_factory.mktemp("tokenizer")
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({ch: len(SPECIAL) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    merges = [("\u0120", "t"), ("h", "e")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def make_llm(tokenizer_dir: Path, num_blocks: int = 256, config: RuntimeConfig | None = None) -> LLM:
    limits = EngineLimits(max_seq_len=256, max_num_tokens=64, eos_token_ids=(EOS,))
    return LLM(Engine(FakeModelRunner(num_blocks, 4, VOCAB), EngineTokenizer(tokenizer_dir), config or RuntimeConfig(),
                      limits, model_name="fake"))


def texts(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[str, str | None]]:
    """(text, finish reason) of every sample; a failed request fails the test with its error."""
    results = []
    for out in llm.generate(prompts, params):
        assert out.error is None, out.error
        results += [(c.text, c.finish_reason) for c in out.outputs]
    return results


# -- specs --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "words"), [
    (lambda: StructuredOutput.regex("a[", "guided_regex"), "unclosed character class"),
    (lambda: StructuredOutput.grammar("start: foo", "guided_grammar"), "unknown name"),
    (lambda: StructuredOutput.json_schema({"type": "strin"}, "guided_json"), "strin"),
    (lambda: StructuredOutput.json_schema({"not": {"type": "string"}}, "guided_json"), "Unimplemented keys"),
    (lambda: StructuredOutput.json_schema("{not json", "guided_json"), "not valid JSON"),
    (lambda: StructuredOutput.choice([], "guided_choice"), "non-empty list"),
])
def test_a_bad_spec_fails_when_made_naming_its_field(make, words):
    with pytest.raises(InvalidParamError) as info:
        make()
    assert words in str(info.value) and info.value.param == str(info.value).split(":")[0]


def test_specs_compare_by_content_and_sampling_params_checks_the_type():
    assert StructuredOutput.json_schema(SCHEMA) == StructuredOutput.json_schema(json.dumps(SCHEMA), "response_format")
    assert hash(StructuredOutput.regex("a+")) == hash(StructuredOutput.regex("a+", "guided_regex"))
    with pytest.raises(InvalidParamError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"type": "json_object"})  # type: ignore[arg-type]


# -- the mask provider ----------------------------------------------------------------------------------------

def test_bitmask_allows_exactly_the_tokens_the_grammar_accepts(tokenizer_dir):
    compiler = GrammarCompiler((tokenizer_dir / "tokenizer.json").read_text(), VOCAB, [EOS])
    state = compiler.compile(StructuredOutput.regex(r"(ab|cd)[0-9]?")).start()
    masks = MaskStep()
    prefix: list[int] = []
    for step_text in ("", "a", "b"):
        prefix += compiler.tokenizer.tokenize_str(step_text) if step_text else []
        state.sync(prefix, 0)
        bits = masks.bitmask([state], VOCAB)[0]
        allowed = {t for t in range(VOCAB) if (int(bits[t // 32]) >> (t % 32)) & 1}
        expected = set()
        for t in range(VOCAB):
            probe = state.matcher.deep_copy()
            if probe.consume_token(t):
                expected.add(t)
        assert allowed == expected and allowed
    assert EOS in allowed and state.accepting  # "ab" is a whole match: it may end


def test_state_follows_output_tokens_both_ways(tokenizer_dir):
    compiler = GrammarCompiler((tokenizer_dir / "tokenizer.json").read_text(), VOCAB, [EOS])
    tokens = compiler.tokenizer.tokenize_str("ab")
    state = compiler.compile(StructuredOutput.choice(["ab", "cd"])).start()
    state.sync([7, 7, *tokens[:2]], 2)  # two prompt tokens, then output
    assert state.consumed == 2
    state.sync([7, 7, *tokens[:1]], 2)  # rolled back a token (a rejected speculative one, say)
    assert state.consumed == 1
    assert compiler.compile(StructuredOutput.choice(["ab", "cd"])) is compiler.compile(StructuredOutput.choice(
        ["ab", "cd"]))  # compiled once per spec


def test_mask_kernel_matches_llguidance_numpy_reference():
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 100, 320):
        logits = rng.normal(size=(3, vocab)).astype(np.float32)
        words = (vocab + 31) // 32
        bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        bitmask[0, 0], bitmask[1, -1] = 0, -1  # whole words off and on
        ref = logits.copy()
        apply_token_bitmask_inplace(ref, bitmask)
        kernels.mask_rows(logits, bitmask)
        np.testing.assert_array_equal(logits, ref)
    short = np.zeros((1, 40), dtype=np.float32)
    kernels.mask_rows(short, np.full((1, 1), -1, dtype=np.int32))  # tokens past the mask's words are off
    assert np.isneginf(short[0, 32:]).all() and (short[0, :32] == 0).all()


# -- generation ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_greedy_and_sampled_with_n_and_logprobs(tokenizer_dir, temperature):
    params = SamplingParams(n=2, temperature=temperature, seed=3, max_tokens=120, logprobs=1,
                            structured=StructuredOutput.json_schema(SCHEMA))
    for text, reason in texts(make_llm(tokenizer_dir), ["hello", "another prompt", "x"], params):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_output_no_longer_validates_without_the_mask(tokenizer_dir, monkeypatch):
    monkeypatch.setattr(MaskStep, "apply", lambda self, logits, states: None)
    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(SCHEMA))
    out = make_llm(tokenizer_dir).generate(["hello"], params)[0]
    assert out.error is not None and "left the grammar" in out.error  # its first token is no JSON


def test_regex_choice_and_grammar_outputs_match(tokenizer_dir):
    llm = make_llm(tokenizer_dir)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=3)
    pattern = r"[0-9]{3}-[a-z]{2}"
    for text, _ in texts(llm, ["a", "b"], dataclasses.replace(sampled, structured=StructuredOutput.regex(pattern))):
        assert re.fullmatch(pattern, text)
    choices = ["apple", "banana", "cherry"]
    for text, _ in texts(llm, ["a", "b"], dataclasses.replace(sampled, structured=StructuredOutput.choice(choices))):
        assert text in choices
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    for text, _ in texts(llm, ["a"], dataclasses.replace(sampled, structured=StructuredOutput.grammar(lark))):
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text)


def test_stop_strings_end_a_structured_output_early(tokenizer_dir):
    params = SamplingParams(temperature=0, max_tokens=120, stop=['"kind"'],
                            structured=StructuredOutput.json_schema(SCHEMA))
    [(text, reason)] = texts(make_llm(tokenizer_dir), ["hello"], params)
    assert reason == "stop" and text.startswith('{"id": ') and '"kind"' not in text


def test_preemption_and_speculation_keep_the_greedy_outputs(tokenizer_dir):
    params = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput.json_schema(SCHEMA))
    prompts = [f"prompt {i} " * (i + 1) for i in range(6)]
    reference = texts(make_llm(tokenizer_dir), prompts, params)
    small = make_llm(tokenizer_dir, num_blocks=48, config=RuntimeConfig(enable_prefix_caching=False))
    assert texts(small, prompts, params) == reference
    assert small.stats().num_preemptions > 0
    speculating = make_llm(tokenizer_dir, config=RuntimeConfig(speculative=SpeculativeConfig("ngram", ngram_min=1)))
    assert texts(speculating, prompts, params) == reference  # greedy: speculation changes no token
    stats = speculating.stats()
    assert stats.num_spec_verifications > 0 and 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens


def test_masks_are_filled_while_the_model_step_runs(tokenizer_dir, monkeypatch):
    """The engine starts each step's fill before running the model; sampling takes it. Same outputs either way."""
    params = SamplingParams(temperature=0, max_tokens=80, n=2, structured=StructuredOutput.json_schema(SCHEMA))
    prompts = [f"prompt {i} " * (i + 1) for i in range(3)]
    fills: list[str] = []
    bitmask = MaskStep.bitmask

    def recorded(step, states, vocab_size):
        fills.append(threading.current_thread().name)
        return bitmask(step, states, vocab_size)

    monkeypatch.setattr(MaskStep, "bitmask", recorded)
    overlapped = texts(make_llm(tokenizer_dir), prompts, params)
    assert fills and all(name.startswith("kiln-grammar-mask") for name in fills), set(fills)
    inline = make_llm(tokenizer_dir)
    inline.engine.sampler.masks.overlap = False
    fills.clear()
    assert texts(inline, prompts, params) == overlapped
    assert fills and not any(name.startswith("kiln-grammar-mask") for name in fills)


def test_speculated_sampled_outputs_follow_the_grammar(tokenizer_dir):
    """Sampled rows verify proposals by rejection sampling on masked rows: whatever is kept or drawn follows the
    schema, and the matcher follows only what was kept (a wrong rollback fails the request's next sync)."""
    llm = make_llm(tokenizer_dir, config=RuntimeConfig(speculative=SpeculativeConfig("ngram", ngram_min=1)))
    params = SamplingParams(temperature=0.3, seed=7, n=3, max_tokens=120,
                            structured=StructuredOutput.json_schema(SCHEMA))
    outputs = texts(llm, [f"prompt {i} " * (i + 1) for i in range(4)], params)
    for text, reason in outputs:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert llm.stats().num_spec_accepted_tokens > 0


def test_speculated_rows_are_masked_after_each_proposal_and_the_matcher_rolled_back(tokenizer_dir):
    compiled = GrammarCompiler(EngineTokenizer(tokenizer_dir).to_json(), VOCAB, [EOS]).compile(
        StructuredOutput.regex("ab[0-9]c"))
    state, tokenizer = compiled.start(), EngineTokenizer(tokenizer_dir)
    a, b, x, five = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abx5")
    proposed = [a, b, x, five]  # the grammar refuses x: rows 0-2 masked, row 3 and 4 left as they were
    logits = np.zeros((5, VOCAB), dtype=np.float32)
    MaskStep().apply_speculated(logits, state, proposed)
    allowed = [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in logits]
    digits = {tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert allowed[:3] == [{a}, {b}, digits]
    assert allowed[3] == allowed[4] == set(range(VOCAB))
    assert state.matcher.validate_tokens([a, b, five]) == 3  # still at the start: nothing consumed


# -- hypothesis: drawn schemas (tests/schemas.py), each with its whole output bounded ----------------------------

@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=bounded_schemas, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**16))
def test_drawn_schemas_every_output_validates(tokenizer_dir, schema, temperature, seed):
    llm = _shared_llm(tokenizer_dir)
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=200,
                            structured=StructuredOutput.json_schema(schema))
    [(text, reason)] = texts(llm, ["generate"], params)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


_llms: dict[Path, LLM] = {}


def _shared_llm(tokenizer_dir: Path) -> LLM:
    """One engine for all the drawn examples (hypothesis calls the test many times per fixture)."""
    if tokenizer_dir not in _llms:
        _llms[tokenizer_dir] = make_llm(tokenizer_dir)
    return _llms[tokenizer_dir]



# -- a reasoning model: the constraint applies after its <think> block --------------------------------------------

THINK_TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def thinking_tokenizer_dir(tokenizer_dir, tmp_path_factory) -> Path:
    """The byte-level tokenizer plus <think> and </think> as added (non-special) tokens, as Qwen3 has them."""
    out = tmp_path_factory.mktemp("thinking-tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    tokenizer.save(str(out / "tokenizer.json"))
    return out


class ThinkingRunner(FakeModelRunner):
    """The fake model, closing its thought (</think>) every few positions: the grammar decides where that counts."""

    def __init__(self, close_id: int, num_blocks: int) -> None:
        super().__init__(num_blocks, 4, VOCAB)
        self.close_id = close_id

    def logits_for(self, tokens: np.ndarray) -> np.ndarray:
        logits = super().logits_for(tokens)
        if len(tokens) % 5 == 0:
            logits[self.close_id] = logits.max() + 10
        return logits


@pytest.mark.parametrize("opened", [True, False])
def test_the_schema_constrains_what_follows_the_thought(thinking_tokenizer_dir, opened):
    tokenizer = EngineTokenizer(thinking_tokenizer_dir)
    open_id, close_id = (tokenizer.encode(t, add_special_tokens=False)[0] for t in THINK_TAGS)
    limits = EngineLimits(max_seq_len=256, max_num_tokens=64, eos_token_ids=(EOS,))
    llm = LLM(Engine(ThinkingRunner(close_id, 256), tokenizer, RuntimeConfig(), limits, model_name="fake"))
    spec = StructuredOutput.json_schema(SCHEMA).after_thinking(opened)
    assert spec != StructuredOutput.json_schema(SCHEMA) and spec.after_thinking(opened) == spec
    prompt = "question <think>\n" if opened else "question"
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=150, n=2, structured=spec)
        for text, reason in texts(llm, [prompt], params):
            assert reason == "stop", text
            if not opened and not text.startswith("<think>"):
                thought, answer = "", text  # it may answer at once
            else:
                thought, answer = text.removeprefix("<think>").split("</think>", 1)
            assert "<think>" not in thought
            jsonschema.validate(json.loads(answer), SCHEMA)
    # where the block's tags are allowed: "{" inside an opened block is thought; </think> never closes an unopened one
    state = GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS]).compile(spec).start()
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    if opened:
        assert state.matcher.validate_tokens([brace, close_id, brace]) == 3
        assert state.matcher.validate_tokens([open_id]) == 0
    else:
        assert state.matcher.validate_tokens([open_id, brace, close_id, brace]) == 4
        assert state.matcher.validate_tokens([close_id]) == 0
