"""`kiln eval`'s driver on the tiny engine: its perplexity is the reference model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.calibration.evaluate import EngineSession, decode_speed, greedy_agreement, perplexity


def test_engine_perplexity_matches_the_reference_model(tiny_engine, tiny_model_dir):
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.reference import ReferenceModel

    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    ids = session.encode("It is a truth universally acknowledged, that a single man in possession " * 6)[:200]
    ppl, count = perplexity(session, ids, window=100, num_windows=2)
    assert count == 2 * 99
    ck = load_checkpoint(tiny_model_dir)
    model = ReferenceModel(ck.spec, ck.weights)
    nll = []
    with torch.no_grad():
        for w in range(2):
            t = torch.tensor(ids[w * 100:(w + 1) * 100])
            logits = model(t[None], torch.arange(100)[None])[0]
            nll.append(torch.nn.functional.cross_entropy(logits[:-1].double(), t[1:], reduction="none"))
    expected = float(torch.exp(torch.cat(nll).mean()))
    assert ppl == pytest.approx(expected, rel=1e-3)
    prompts = [ids[:10], ids[50:70]]
    assert greedy_agreement(session, session, prompts, new_tokens=8) == 1.0
    assert decode_speed(session, ids[:10], new_tokens=4) > 0
    assert np.isfinite(ppl)


def test_loop_check_flags_a_looping_tail_not_a_template():
    from kiln.calibration.evaluate import loops

    assert loops([9, 8] + [7, 1, 2, 3, 4] * 3 + [7, 1])  # cut anywhere inside the cycle
    assert loops([5] * 3)
    assert not loops([1, 2, 3, 4, 5, 1, 2, 3, 4, 6])  # a phrase said twice is not a loop
    assert not loops([1, 10, 2, 3, 1, 11, 2, 3, 1, 12, 2, 3])  # list items sharing a template
    assert not loops(list(range(64))) and not loops([])


def test_chat_answers_run_through_the_serving_runtime(tiny_engine):
    from kiln.calibration.evaluate import CHAT_QUESTIONS, chat_answers, loops
    from kiln.runtime import LLM, SamplingParams

    answers = chat_answers(tiny_engine, max_tokens=12, threads=1)
    assert [a["question"] for a in answers] == list(CHAT_QUESTIONS)
    expected = LLM(tiny_engine).chat([{"role": "user", "content": CHAT_QUESTIONS[1]}],
                                     SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert answers[1]["answer"] == expected.text
    assert answers[1]["degenerate"] == loops(list(expected.token_ids))


def test_kiln_eval_report_on_the_tiny_engine(tiny_engine):
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["eval", str(tiny_engine), "--reference", str(tiny_engine),
                                       "--windows", "2", "--window-tokens", "64", "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["eval_tokens"] == 2 * 63 and np.isfinite(report["perplexity"])
    assert report["text"] == "janeaustenr:persuasion"
    assert report["greedy_agreement"] == 1.0  # the engine against itself
    assert len(report["chat"]) == 4 and report["degenerate_answers"] == sum(a["degenerate"] for a in report["chat"])
    assert report["degenerate_in_reference_too"] == report["degenerate_answers"]  # the engine against itself
    assert report["engine_mb"] > 0 and report["decode_tok_s"] > 0


def test_divergence_finds_where_an_answer_leaves_the_reference(tiny_engine):
    from kiln.calibration.evaluate import divergence, loops

    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    prompt = session.encode("It is a truth universally acknowledged")
    greedy = session.greedy(prompt, 12)
    assert divergence(session, prompt, greedy) == {"token_index": None}
    other = next(t for t in range(5, 300) if t != greedy[5])
    answer = greedy[:5] + [other] + greedy[:6]  # leaves the greedy path at token 5
    found = divergence(session, prompt, answer)
    assert found["token_index"] == 5 and found["reference_margin"] > 0
    logits = session.prefill(prompt + greedy[:5])[-1].astype(np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert found["reference_margin"] == pytest.approx(logprobs[greedy[5]] - logprobs[other], rel=1e-5)
    forced = greedy[:5] + [other] + session.greedy(prompt + greedy[:5] + [other], 6)
    assert found["reference_loops_too"] == loops(forced)


def test_kiln_eval_on_a_text_file_and_a_too_short_one(tiny_engine, tmp_path):
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    text = tmp_path / "licence.txt"
    text.write_text("Everyone is permitted to copy and distribute verbatim copies of this license document. " * 40)
    args = ["eval", str(tiny_engine), "--windows", "2", "--window-tokens", "64", "--threads", "1", "--text"]
    result = CliRunner().invoke(main, args + [str(text)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["text"] == str(text) and report["eval_tokens"] == 2 * 63
    session = EngineSession(tiny_engine, max_tokens=256, threads=1)
    assert report["perplexity"] == pytest.approx(perplexity(session, session.encode(text.read_text()), 64, 2)[0], rel=1e-6)
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    result = CliRunner().invoke(main, args + [str(short)])
    assert result.exit_code != 0 and "not one window of 64" in result.output
