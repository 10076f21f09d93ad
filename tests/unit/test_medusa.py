"""Medusa heads, build-time side: self-distillation data from the torch reference, training on a tiny
model, scoring, the artifact, and the manifest's record of the heads (old manifests still load)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_hf_model
from medusa_fixtures import tiny_text

from kiln.errors import InvalidParamError
from kiln.export.checkpoint import load_checkpoint
from kiln.export.reference import ReferenceModel
from kiln.heads.medusa_data import Continuations, greedy_states
from kiln.heads.medusa_heads import MedusaArtifact, MedusaError, MedusaHeads
from kiln.heads.medusa_train import (
    IGNORE,
    HeadRows,
    MedusaConfig,
    rows_and_labels,
    score,
    train_heads,
    train_medusa,
)
from kiln.manifest import BuildOptions, Manifest
from kiln.medusa import MedusaSpec

FAST = MedusaConfig(num_heads=2, text_prompts=4, chat_prompts=4, prompt_tokens=16, new_tokens=12, epochs=3,
                    batch_rows=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), family="mistral", sliding_window=8))


@pytest.fixture(scope="module")
def artifact(checkpoint):
    return train_medusa(checkpoint, tiny_text(), FAST)


def test_greedy_states_are_the_reference_models(checkpoint):
    """Cached, left-padded, sliding-window generation gives the reference's own greedy tokens and states."""
    from kiln.calibration.collect import run_layers

    model = ReferenceModel.from_checkpoint(checkpoint)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [40] * 12]
    out = greedy_states(model, prompts, 10)
    for b, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + out.tokens[b].tolist()])
        positions = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            assert model(ids, positions)[0, len(prompt) - 1:-1].argmax(-1).tolist() == out.tokens[b].tolist()
            states = run_layers(model, ids, positions)[0, len(prompt) - 1:-1]
        torch.testing.assert_close(out.states[b], states, atol=1e-4, rtol=0)


def test_labels_are_the_tokens_i_steps_ahead_and_stop_at_the_end():
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    c = Continuations(torch.randn(2, 5, 4), tokens, torch.tensor([5, 3]))  # row 1 ends at its 3rd token

    class Model:  # rows_and_labels reads the final norm only
        class model:  # noqa: N801
            norm = staticmethod(lambda x: x)

    x, labels = rows_and_labels([c], Model, num_heads=2)
    assert x.shape == (8, 4)
    assert labels.tolist() == [[11, 12], [12, 13], [13, 14], [14, IGNORE], [IGNORE, IGNORE],
                               [21, 22], [22, IGNORE], [IGNORE, IGNORE]]


def test_score_counts_a_chain_up_to_its_first_miss():
    heads = MedusaHeads(2, 4)  # zero: each head says what the "LM head" (identity) says
    x = torch.eye(4)  # row r predicts token r with every head
    labels = torch.tensor([[0, 0], [1, 9], [9, 2], [3, IGNORE]])
    result = score(heads, x, labels, torch.eye(4))
    assert result["top1_accuracy"] == [pytest.approx(3 / 4, abs=1e-4), pytest.approx(2 / 3, abs=1e-4)]
    assert result["chain_rows"] == 3
    assert result["mean_accepted_tokens"] == pytest.approx(1 + (2 + 1 + 0) / 3, abs=1e-4)


def test_training_fits_the_heads_and_is_deterministic(checkpoint, artifact):
    info = artifact.info
    assert info["num_heads"] == 2 and info["hidden_size"] == checkpoint.spec.hidden_size
    assert info["model_fingerprint"] == checkpoint.fingerprint()
    assert info["data"]["train_prompts"] == 7 and info["data"]["heldout_prompts"] == 1
    assert [e["epoch"] for e in info["epochs"]] == [1, 2, 3] and info["epochs"][-1]["loss"] < info["epochs"][0]["loss"]
    assert all(1 <= e["heldout_accepted"] <= 3 for e in info["epochs"])
    # early stopping: the kept heads are the best held-out epoch's
    assert info["heldout"]["mean_accepted_tokens"] == max(e["heldout_accepted"] for e in info["epochs"])
    for split in ("train", "heldout", "chat"):
        assert len(info[split]["top1_accuracy"]) == 2 and 1 <= info[split]["mean_accepted_tokens"] <= 3
    # the same rows and seed give the same heads; zero heads (the LM head) score worse on what they trained on
    model = ReferenceModel.from_checkpoint(checkpoint)
    continuations = greedy_states(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 12)
    x, labels = rows_and_labels([continuations], model, 2)
    config = dataclasses.replace(FAST, epochs=10, batch_rows=8, learning_rate=1e-2)
    head = model.model.embed_tokens.weight
    first, _ = train_heads(HeadRows(x, labels), head, config, lambda _m: None)
    second, _ = train_heads(HeadRows(x, labels), head, config, lambda _m: None)
    assert torch.equal(first.weight, second.weight) and torch.equal(first.bias, second.bias)

    def loss(heads: MedusaHeads) -> float:
        logits = heads.logits(x, head)
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE))

    assert loss(first) < 0.9 * loss(MedusaHeads(2, x.shape[1]))


def test_artifact_round_trip_and_refusals(artifact, checkpoint, tmp_path):
    out = artifact.save(tmp_path / "heads")
    loaded = MedusaArtifact.load(out)
    assert loaded.info == json.loads(json.dumps(artifact.info))
    for name, tensor in artifact.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor)
    loaded.check_model(checkpoint)
    assert loaded.spec() == MedusaSpec(2, checkpoint.spec.hidden_size,
                                       tuple(artifact.info["heldout"]["top1_accuracy"]))
    weights, biases = loaded.arrays()
    assert weights.shape == (2, checkpoint.spec.hidden_size, checkpoint.spec.hidden_size)
    assert biases.shape == (2, checkpoint.spec.hidden_size)

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(MedusaError, match="refusing to overwrite"):
        artifact.save(tmp_path / "other")
    with pytest.raises(MedusaError, match="not a Medusa heads directory"):
        MedusaArtifact.load(tmp_path / "other")
    info = json.loads((out / "medusa.json").read_text())
    (out / "medusa.json").write_text(json.dumps({**info, "format": 99}))
    with pytest.raises(MedusaError, match="format 99"):
        MedusaArtifact.load(out)
    other = load_checkpoint(make_tiny_hf_model(tmp_path / "m", family="llama", seed=3))
    with pytest.raises(MedusaError, match="fingerprints differ"):
        loaded.check_model(other)


def test_config_names_a_bad_field():
    with pytest.raises(InvalidParamError, match="num_heads must be a positive integer"):
        MedusaConfig(num_heads=0)
    with pytest.raises(InvalidParamError, match="new_tokens must be more than num_heads"):
        MedusaConfig(num_heads=4, new_tokens=4)


def test_manifest_records_the_heads_and_old_manifests_load(checkpoint, tmp_path):
    spec = MedusaSpec(3, checkpoint.spec.hidden_size, (0.6, 0.4, 0.3))
    manifest = Manifest(spec=checkpoint.spec, build=BuildOptions(max_seq_len=2048, medusa=tmp_path),
                        backend="onnxruntime-cpu", graph_inputs=("input_ids",),
                        graph_outputs=("logits", "medusa_logits"), medusa=spec)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest and again.medusa == spec and again.build.medusa == tmp_path
    old = json.loads(manifest.to_json())
    del old["medusa"], old["build"]["medusa"]  # what kiln wrote before Medusa heads
    legacy = Manifest.from_json(json.dumps(old))
    assert legacy.medusa is None and legacy.build.medusa is None
    with pytest.raises(InvalidParamError, match="num_heads"):
        MedusaSpec(0, 64)
    with pytest.raises(InvalidParamError, match="top1_accuracy"):
        MedusaSpec(2, 64, (0.5,))


@pytest.mark.parametrize("batch_tokens", [4096, 16])  # both sequences in one padded batch, or one each
def test_teacher_forced_rows_are_the_greedy_states(checkpoint, batch_tokens):
    """Chat answers' rows from one forward of prompt + answer: the states and labels greedy decoding gives."""
    from kiln.heads.medusa_chat import teacher_forced_rows

    model = ReferenceModel.from_checkpoint(checkpoint)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    out = greedy_states(model, prompts, 10)
    answers = [(p, out.tokens[b].tolist()) for b, p in enumerate(prompts)]
    x, labels = teacher_forced_rows(model, answers, 3, lambda _m: None, batch_tokens=batch_tokens)
    want_x, want_labels = rows_and_labels([dataclasses.replace(out, lengths=torch.tensor([10, 10]))], model, 3)
    torch.testing.assert_close(x, want_x, atol=1e-4, rtol=0)
    assert torch.equal(labels, want_labels)


def test_early_stopping_keeps_the_best_held_out_epoch(checkpoint):
    """Trained on rows whose labels contradict the held-out ones, the heads only get worse there: early
    stopping keeps epoch 1's heads, whatever the later epochs did."""
    model = ReferenceModel.from_checkpoint(checkpoint)
    x, labels = rows_and_labels([greedy_states(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 12)], model, 2)
    head = model.model.embed_tokens.weight
    wrong = torch.where(labels == IGNORE, IGNORE, (labels + 1) % head.shape[0])
    config = dataclasses.replace(FAST, epochs=4, batch_rows=8, learning_rate=1e-2)
    heads, history = train_heads(HeadRows(x, wrong), head, config, lambda _m: None, heldout=HeadRows(x, labels))
    accepted = [e["heldout_accepted"] for e in history]
    assert accepted[0] > accepted[-1]
    assert score(heads, x, labels, head)["mean_accepted_tokens"] == max(accepted)


def test_label_vocabulary_trains_on_the_labels_tokens(checkpoint):
    from kiln.heads.medusa_train import label_vocabulary

    head = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)  # row v is [v, v, v]: token 9 scores best
    labels = torch.tensor([[7, 2], [2, IGNORE], [IGNORE, 5]])
    sub, renumbered = label_vocabulary(torch.ones(3, 3), labels, head, rivals=1)
    assert sub[:, 0].tolist() == [2, 5, 7, 9] and renumbered.tolist() == [[2, 0], [0, IGNORE], [IGNORE, 1]]
    # heads trained over the labels' vocabulary still fit them through the full LM head
    model = ReferenceModel.from_checkpoint(checkpoint)
    x, labels = rows_and_labels([greedy_states(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 12)], model, 2)
    config = dataclasses.replace(FAST, epochs=10, batch_rows=8, learning_rate=1e-2, label_vocabulary=True)
    full = model.model.embed_tokens.weight
    heads, _ = train_heads(HeadRows(x, labels), full, config, lambda _m: None)
    assert score(heads, x, labels, full)["top1_accuracy"][1] > score(MedusaHeads(2, x.shape[1]), x, labels,
                                                                     full)["top1_accuracy"][1]


def test_open_questions_pair_headwords_with_templates_prefix_stably(monkeypatch):
    from kiln.heads import medusa_chat

    monkeypatch.setattr(medusa_chat, "headwords", lambda: ["apple", "bread", "cloud", "door"])
    pairs = 4 * len(medusa_chat.TEMPLATES)
    questions = medusa_chat.open_questions(pairs)
    assert len(set(questions)) == pairs  # every (word, template) pair once
    assert medusa_chat.open_questions(10) == questions[:10]  # a longer list starts with the shorter one
    assert "What is an apple?" in questions
    with pytest.raises(ValueError, match=f"fewer than {pairs + 1}"):
        medusa_chat.open_questions(pairs + 1)


def test_chat_prompts_never_hold_the_benchmark_questions(monkeypatch):
    from kiln.heads import medusa_chat
    from kiln.heads.medusa_data import CHAT_QUESTIONS

    monkeypatch.setattr(medusa_chat, "corpus_requests", lambda n: [f"request {i}" for i in range(n)])
    prompts = medusa_chat.chat_prompts(40)
    assert prompts[14] == "request 0" and prompts[29] == "request 1" and len(set(prompts)) == 40
    assert not set(prompts) & set(CHAT_QUESTIONS)
    monkeypatch.setattr(medusa_chat, "corpus_requests", lambda n: [CHAT_QUESTIONS[0]] * n)
    with pytest.raises(AssertionError, match="held-out CHAT_QUESTIONS"):
        medusa_chat.chat_prompts(15)


class _ScriptedLLM:
    """A runtime.LLM stand-in for sample_user_turns: a ChatML template and one scripted turn per seed."""

    class tokenizer:  # noqa: N801 (an attribute, as LLM.tokenizer is)
        @staticmethod
        def apply_chat_template(messages):
            return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
                "<|im_start|>assistant\n"

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def generate(self, prompts, params):
        from types import SimpleNamespace

        self.calls.append((prompts[0], [p.seed for p in params], params[0].stop))
        turns = [self.turns(p.seed) for p in params]
        return [SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason=reason)]) for text, reason in turns]


def test_self_instructed_prompts_keep_closed_distinct_turns_and_never_a_held_out_question():
    from kiln.heads.medusa_chat import same_question, sample_user_turns
    from kiln.heads.medusa_data import CHAT_QUESTIONS

    def turns(seed):
        if seed % 10 == 3:
            return f"a turn cut off at {seed}", "length"  # no question: dropped
        if seed % 10 == 5:
            return "  How are you?  ", "stop"  # the same turn again: kept once
        if seed % 10 == 7:
            return "why is the sky blue, and why are sunsets red", "stop"  # holds a held-out question
        return f"question {seed}?", "stop"

    llm = _ScriptedLLM(turns)
    prompts = sample_user_turns(llm, 100, lambda _m: None, seed=2)
    assert len(prompts) == 100 == len(set(prompts)) and prompts.count("How are you?") == 1
    assert not any("cut off" in p or same_question(p) for p in prompts)
    opening, seeds, stop = llm.calls[0]
    assert opening.endswith("<|im_start|>user\n") and "\x00" not in opening and stop == ("<|im_end|>",)
    assert [s % 1_000_003 for s in seeds] == list(range(100)) and len(llm.calls) == 2  # 100 drawn, 71 kept: more drawn
    assert sample_user_turns(_ScriptedLLM(turns), 100, lambda _m: None, seed=2) == prompts  # reproducible
    assert same_question(CHAT_QUESTIONS[8].upper()) and not same_question("Why is the sky so grey?")


def test_mixed_prompts_hold_out_both_kinds_alike(monkeypatch, tmp_path):
    from kiln.heads import medusa_chat
    from kiln.heads.medusa_train import HOLDOUT_EVERY, ChatAnswers, interleave_runs

    assert interleave_runs(list("abcde"), list("XYZ"), 2) == list("abXYcdZe")
    asked = []

    def written(engine, count, threads, say, cache, seed):
        asked.append((count, cache, seed))
        return [f"own {i}" for i in range(count)]

    monkeypatch.setattr(medusa_chat, "self_instructed_prompts", written)
    monkeypatch.setattr(medusa_chat, "chat_prompts", lambda n: [f"templated {i}" for i in range(n)])
    source = ChatAnswers("/e", prompts=35, cache=tmp_path / "answers.jsonl")
    prompts = source.chat_prompts(3, lambda _m: None)
    assert asked == [(17, tmp_path / "answers.prompts.json", 3)] and len(prompts) == 35 == len(set(prompts))
    held = prompts[HOLDOUT_EVERY - 1::HOLDOUT_EVERY]
    assert held == ["own 7", "templated 7", "own 15", "templated 15"]
    assert ChatAnswers("/e", prompts=16, prompt_source="self").chat_prompts(0, lambda _m: None)[-1] == "own 15"
    assert ChatAnswers("/e", prompts=16, prompt_source="templates").chat_prompts(0, print)[0] == "templated 0"
    with pytest.raises(InvalidParamError, match="prompt_source must be one of"):
        ChatAnswers("/e", prompt_source="web")


def test_answer_cache_resumes_and_refuses_another_engine(tmp_path):
    from kiln.heads import medusa_chat

    cache = tmp_path / "answers.jsonl"
    header = {"engine": "/e", "max_tokens": 8}
    medusa_chat._append_cache(cache, header, {"q1": ([1, 2], [3])})
    medusa_chat._append_cache(cache, header, {"q2": ([4], [5, 6])})
    assert medusa_chat._read_cache(cache, header) == {"q1": ([1, 2], [3]), "q2": ([4], [5, 6])}
    with pytest.raises(ValueError, match="use another file"):
        medusa_chat._read_cache(cache, {"engine": "/e", "max_tokens": 16})


def test_training_rows_are_scored_on_a_fixed_sample():
    from kiln.heads.medusa_train import _sample

    x, labels, chosen = torch.arange(10.0)[:, None], torch.arange(10)[:, None], torch.arange(10) + 100
    assert _sample(x, labels, chosen, None)[0] is x and _sample(x, labels, chosen, 10)[0] is x
    a, b = _sample(x, labels, chosen, 4), _sample(x, labels, chosen, 4)
    assert a[0].shape == (4, 1) and torch.equal(a[0], b[0]) and torch.equal(a[0][:, 0].long(), a[1][:, 0])
    assert torch.equal(a[2], a[1][:, 0] + 100)  # each row keeps its chosen token


@pytest.mark.parametrize("option", ["--answer-cache", "--rows-cache"])
def test_cli_caches_need_answers_from(tmp_path, option):
    from click.testing import CliRunner

    from kiln.cli.medusa import train_medusa as command

    result = CliRunner().invoke(command, ["default", "-o", str(tmp_path / "h"), option, str(tmp_path / "cache")])
    assert result.exit_code == 2 and f"{option} needs --answers-from" in result.output


def test_rows_cache_is_reused_only_for_the_same_answers_and_model(checkpoint, tmp_path):
    """Written once, read back equal; answers that differ (labels) or another model (states) are refused."""
    from kiln.heads.medusa_chat import cached_rows, teacher_forced_rows

    model = ReferenceModel.from_checkpoint(checkpoint)
    out = greedy_states(model, [[5, 6, 7, 8, 9], [20, 21, 22]], 8)
    splits = {"train": [([5, 6, 7, 8, 9], out.tokens[0].tolist())], "chat": [([20, 21, 22], out.tokens[1].tolist())]}
    cache = tmp_path / "rows.pt"
    written = cached_rows(model, splits, 2, lambda _m: None, cache)
    messages: list[str] = []
    read = cached_rows(model, splits, 2, messages.append, cache)
    for name, seqs in splits.items():
        want = teacher_forced_rows(model, seqs, 2, lambda _m: None)
        for got in (written[name], read[name]):
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
            assert torch.equal(got[1], want[1])
    assert messages and "read from" in messages[0]
    fewer = cached_rows(model, splits, 1, lambda _m: None, cache)  # rows cached for 2 heads serve 1
    assert torch.equal(fewer["train"][1], written["train"][1][:, :1])
    other_answer = {**splits, "chat": [([20, 21, 22], [t + 1 for t in splits["chat"][0][1]])]}
    with pytest.raises(ValueError, match="other answers"):
        cached_rows(model, other_answer, 2, lambda _m: None, cache)
    with pytest.raises(ValueError, match="splits"):
        cached_rows(model, {"train": splits["train"]}, 2, lambda _m: None, cache)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # another model: same answers, other states
    try:
        with pytest.raises(ValueError, match="another model"):
            cached_rows(model, splits, 2, lambda _m: None, cache)
    finally:
        with torch.no_grad():
            model.model.norm.weight.mul_(0.5)


def test_artifact_records_every_training_row_though_it_scores_a_sample(checkpoint, monkeypatch):
    from kiln.heads import medusa_train

    monkeypatch.setattr(medusa_train, "SCORED_TRAIN_ROWS", 5)
    model = ReferenceModel.from_checkpoint(checkpoint)
    x, labels = rows_and_labels([greedy_states(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 12)], model, 2)
    chosen = torch.zeros(len(x), dtype=torch.int64)  # read by hydra heads only
    data = {"train": (x, labels, chosen), "heldout": (x[:6], labels[:6], chosen[:6]),
            "chat": (x[:6], labels[:6], chosen[:6])}
    config = dataclasses.replace(FAST, epochs=1)
    artifact = medusa_train._fit(checkpoint, model, data, config, lambda _m: None,
                                 medusa_train._Provenance("test", {}, 0.0, 0.0))
    assert artifact.info["data"]["train_rows"] == x.shape[0] == 24 and artifact.info["train"]["rows"] == 5
