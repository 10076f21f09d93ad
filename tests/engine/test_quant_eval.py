"""`kiln eval`'s driver on the tiny engine, checked against the transformers model of the same
checkpoint: its perplexity, greedy tokens, chat answers and loop tracing are the PyTorch model's."""

from __future__ import annotations

import itertools
import json
import types

import numpy as np
import onnx
import pytest
import torch

from kiln.evaluation import evaluate
from kiln.evaluation.evaluate import EngineSession, decode_speed, greedy_agreement, loops, perplexity

TEXT = "It is a truth universally acknowledged, that a single man in possession " * 6


class TorchModel:
    """The transformers model and tokenizer of a checkpoint dir, greedy by full recomputation."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([tokens])).logits[0].double()

    def greedy(self, prompt: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
        out: list[int] = []
        while len(out) < new_tokens and (not out or out[-1] != eos):
            out.append(int(self.logits(prompt + out)[-1].argmax()))
        return out

    def chat(self, question: str, max_tokens: int) -> tuple[list[int], list[int], str]:
        """(prompt ids, greedy answer ids, answer text) of a one-question chat."""
        prompt = list(self.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                         add_generation_prompt=True, return_dict=True)["input_ids"])
        ids = self.greedy(prompt, max_tokens, eos=self.tokenizer.eos_token_id)
        return prompt, ids, self.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def torch_model(tiny_model_dir) -> TorchModel:
    return TorchModel(tiny_model_dir)


def fake_clock(monkeypatch, step_s: float) -> None:
    """evaluate's clock advances step_s per reading: every timed decode step takes step_s."""
    ticks = itertools.count()
    monkeypatch.setattr(evaluate, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * step_s))


def torch_perplexity(model: TorchModel, ids: list[int], window: int, num_windows: int, first: int = 0) -> float:
    """Over num_windows windows, the tokens predicted from the logits at positions first.. of each."""
    nll = [torch.nn.functional.cross_entropy(model.logits(ids[w * window:(w + 1) * window])[first:-1],
                                             torch.tensor(ids[w * window + first + 1:(w + 1) * window]),
                                             reduction="none")
           for w in range(num_windows)]
    return float(torch.exp(torch.cat(nll).mean()))


def torch_agreement(model: TorchModel, reference: TorchModel, prompts: list[list[int]], new_tokens: int) -> float:
    """Teacher-forced: how often model's argmax is reference's greedy token."""
    agree = []
    for prompt in prompts:
        continuation = reference.greedy(prompt, new_tokens)
        argmax = model.logits(prompt + continuation[:-1])[len(prompt) - 1:].argmax(-1)
        agree += (argmax == torch.tensor(continuation)).tolist()
    return float(np.mean(agree))


def test_engine_perplexity_and_greedy_tokens_are_the_torch_models(tiny_engine, torch_model):
    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    ids = session.encode(TEXT)[:200]
    assert ids == torch_model.encode(TEXT)[:200]
    ppl, count = perplexity(session, ids, window=100, num_windows=2)
    assert count == 2 * 99
    assert ppl == pytest.approx(torch_perplexity(torch_model, ids, 100, 2), rel=1e-4)
    prompts = [ids[:10], ids[50:70]]
    assert greedy_agreement(session, torch_model, prompts, new_tokens=8) == 1.0
    # a reference whose last token of the first prompt differs: exactly 1 of the 16 positions
    off = types.SimpleNamespace(greedy=lambda p, n: torch_model.greedy(p, n)[:-1] + [0] if p == prompts[0]
                                else torch_model.greedy(p, n))
    assert torch_model.greedy(prompts[0], 8)[-1] != 0
    assert greedy_agreement(session, off, prompts, new_tokens=8) == 15 / 16


def test_decode_speed_is_one_over_the_median_step(tiny_engine, monkeypatch):
    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    fake_clock(monkeypatch, 0.004)
    assert decode_speed(session, session.encode(TEXT)[:10], new_tokens=4) == pytest.approx(250.0)


def test_loop_check_flags_a_looping_tail_not_a_template():
    assert loops([9, 8] + [7, 1, 2, 3, 4] * 3 + [7, 1])  # cut anywhere inside the cycle
    assert loops([5] * 3)
    assert not loops([1, 2, 3, 4, 5, 1, 2, 3, 4, 6])  # a phrase said twice is not a loop
    assert not loops([1, 10, 2, 3, 1, 11, 2, 3, 1, 12, 2, 3])  # list items sharing a template
    assert not loops(list(range(64))) and not loops([])


def test_chat_answers_are_the_torch_models_greedy_chat(tiny_engine, torch_model):
    from kiln.evaluation.evaluate import CHAT_QUESTIONS, chat_answers

    answers = chat_answers(tiny_engine, max_tokens=12, threads=1)
    assert [a["question"] for a in answers] == list(CHAT_QUESTIONS)
    for answer in answers:
        prompt, ids, text = torch_model.chat(answer["question"], 12)
        assert (answer["prompt_ids"], answer["answer_ids"], answer["answer"]) == (prompt, ids, text)
        assert answer["degenerate"] == loops(ids)


def expected_reference_loops(reference: TorchModel, answers: list[tuple[list[int], list[int]]]) -> int:
    """Of the looping (prompt, answer) pairs, how many the reference loops on too: it gives the
    same answer, or loops once forced through the answer's first token it would not have chosen."""
    count = 0
    for prompt, answer in answers:
        if not loops(answer):
            continue
        argmax = reference.logits(prompt + answer)[len(prompt) - 1:-1].argmax(-1).tolist()
        first = next((i for i, (a, b) in enumerate(zip(argmax, answer, strict=True)) if a != b), None)
        if first is None:
            count += 1
        else:
            forced = answer[:first + 1]
            count += loops(forced + reference.greedy(prompt + forced, len(answer) - first - 1))
    return count


def test_kiln_eval_report_against_another_model(tiny_engine, tiny_model_dir, torch_model, tmp_path, monkeypatch):
    from click.testing import CliRunner
    from helpers import make_tiny_hf_model

    from kiln.cli import main
    from kiln.corpus import DOMAINS, evaluation_text, token_digest
    from kiln.corpus.windows import domain_windows
    from kiln.evaluation.evaluate import CHAT_QUESTIONS
    from kiln.optimize.build import build_engine

    other_dir = make_tiny_hf_model(tmp_path / "other", seed=1)
    build_engine(other_dir, tmp_path / "other-engine", progress=lambda _msg: None)
    fake_clock(monkeypatch, 0.01)
    result = CliRunner().invoke(main, ["eval", str(tiny_engine), "--reference", str(tmp_path / "other-engine"),
                                       "--windows", "2", "--window-tokens", "64", "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["text"] == "corpus:evaluation"
    assert report["eval_tokens"] == {domain: 2 * 63 for domain in DOMAINS}
    assert list(report["corpus"]["domains"]) == list(DOMAINS)

    # each domain's windows, chat rendered by transformers' own apply_chat_template
    class HFTemplate:
        template = "transformers"

        @staticmethod
        def render(messages, add_generation_prompt):
            return torch_model.tokenizer.apply_chat_template(messages, tokenize=False,
                                                             add_generation_prompt=add_generation_prompt)

    for domain in DOMAINS:
        windows = domain_windows(domain, "evaluation", torch_model.encode, 64, 2, HFTemplate).windows
        assert report["corpus"]["domains"][domain]["token_sha256"] == token_digest(windows)
        expected = torch_perplexity(torch_model, [t for w in windows for t in w], 64, 2)
        assert report["perplexity"][domain] == pytest.approx(expected, rel=1e-4), domain

    other = TorchModel(other_dir)
    text = evaluation_text()
    prompts = evaluate.prompt_set(text, torch_model)
    agreement = torch_agreement(torch_model, other, prompts, 32)
    assert 0 < agreement < 1  # two random models: the figure can disagree either way
    assert report["greedy_agreement"] == pytest.approx(agreement, abs=1e-9)
    assert report["decode_tok_s"] == pytest.approx(100.0)  # one step per 10 ms of the fake clock
    engine_bytes = sum(p.stat().st_size for p in tiny_engine.rglob("*") if p.is_file())
    assert report["engine_mb"] == pytest.approx(engine_bytes / 2**20)

    # The engine's greedy answers follow transformers' token for token, except where transformers itself
    # sees a near-tie that float32 rounding may flip (random weights loop on a few tokens for 64 steps).
    kiln_answers = evaluate.chat_answers(tiny_engine, 64, threads=1)
    for kiln, question in zip(kiln_answers, CHAT_QUESTIONS, strict=True):
        prompt, ids, _ = torch_model.chat(question, 64)
        assert kiln["prompt_ids"] == prompt
        kiln_ids = kiln["answer_ids"]
        first = next((i for i, (a, b) in enumerate(zip(kiln_ids, ids, strict=False)) if a != b), None)
        if first is None:
            assert kiln_ids == ids
        else:
            logits = torch_model.logits(prompt + kiln_ids[:first])[-1]
            assert float(logits[ids[first]] - logits[kiln_ids[first]]) < 1e-4, (question, first)
    assert [a["question"] for a in report["chat"]] == list(CHAT_QUESTIONS)
    assert [a["answer"] for a in report["chat"]] == [a["answer"] for a in kiln_answers]
    assert report["degenerate_answers"] == sum(loops(a["answer_ids"]) for a in kiln_answers)
    expected = expected_reference_loops(other, [(a["prompt_ids"], a["answer_ids"]) for a in kiln_answers])
    assert report["degenerate_in_reference_too"] == expected


def test_divergence_finds_where_an_answer_leaves_the_reference(tiny_engine, torch_model):
    from kiln.evaluation.evaluate import divergence

    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    prompt = session.encode("It is a truth universally acknowledged")
    greedy = torch_model.greedy(prompt, 12)
    assert divergence(session, prompt, greedy) == {"token_index": None}
    other = next(t for t in range(5, 300) if t != greedy[5])
    answer = greedy[:5] + [other] + greedy[:6]  # leaves the greedy path at token 5
    found = divergence(session, prompt, answer)
    logprobs = torch.log_softmax(torch_model.logits(prompt + greedy[:5])[-1], -1)
    assert found["token_index"] == 5
    assert found["reference_margin"] == pytest.approx(float(logprobs[greedy[5]] - logprobs[other]), rel=1e-4)
    forced = greedy[:5] + [other] + torch_model.greedy(prompt + greedy[:5] + [other], 6)
    assert found["reference_loops_too"] == loops(forced)


def test_kiln_eval_on_a_text_file_and_a_too_short_one(tiny_engine, torch_model, tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    text = tmp_path / "licence.txt"
    text.write_text("Everyone is permitted to copy and distribute verbatim copies of this license document. " * 40)
    args = ["eval", str(tiny_engine), "--windows", "2", "--window-tokens", "64", "--threads", "1", "--text"]
    result = CliRunner().invoke(main, args + [str(text)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["text"] == str(text) and report["eval_tokens"] == {"text": 2 * 63}
    expected = torch_perplexity(torch_model, torch_model.encode(text.read_text()), 64, 2)
    assert report["perplexity"] == {"text": pytest.approx(expected, rel=1e-4)} and report["scored"] == "all"
    result = CliRunner().invoke(main, args + [str(text), "--score-second-half"])  # llama-perplexity's tokens
    report = json.loads(result.output[result.output.index("{"):])
    assert report["eval_tokens"] == {"text": 2 * 31} and report["scored"] == "second half"
    expected = torch_perplexity(torch_model, torch_model.encode(text.read_text()), 64, 2, first=32)
    assert report["perplexity"] == {"text": pytest.approx(expected, rel=1e-4)}
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    result = CliRunner().invoke(main, args + [str(short)])
    assert result.exit_code != 0 and "not one window of 64" in result.output


def test_a_rescored_head_is_scored_on_the_rows_decoding_takes(tiny_model_dir, tmp_path):
    """eval prefills an int4-rescored engine RESCORED_HEAD_MAX_ROWS rows a step, the steps that take the rescored
    path behind any int4 head; an int4-q4_1 engine's head is rescored at every step, so a row's logits do not
    depend on how many rows share its step (no int8 head behind an If)."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import RESCORED_HEAD_MAX_ROWS, LmHead, QuantScheme

    engine = tmp_path / "rescored"
    build_engine(tiny_model_dir, engine, BuildOptions(quantization=QuantScheme.parse("int4-q4_1"),
                                                      lm_head=LmHead.INT4_RESCORED), progress=lambda _m: None)
    session = EngineSession(engine, max_tokens=256, threads=1)
    assert session.logits_chunk == RESCORED_HEAD_MAX_ROWS
    tokens = list(range(5, 45))
    decoding, scored, whole = (session.prefill(tokens, chunk) for chunk in (1, None, 40))
    for logits in (scored, whole):
        np.testing.assert_allclose(logits, decoding, rtol=0, atol=1e-4 * np.abs(decoding).max())
    assert "If" not in {node.op_type for node in onnx.load(engine / "model.onnx", load_external_data=False).graph.node}
