"""Hydra heads (kiln/medusa.py kind "hydra"), build-time side: the draft vocabulary, training on a tiny
model (each head reads the token before its own), the artifact, and the draft graph the engine runs,
checked against a numpy reference and against the torch heads' own free-running chain."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import make_tiny_hf_model
from medusa_fixtures import tiny_text

from kiln.export.checkpoint import load_checkpoint
from kiln.export.reference import ReferenceModel
from kiln.heads.medusa_data import greedy_states, lm_head_weight
from kiln.heads.medusa_heads import HydraHeads, MedusaArtifact, MedusaError
from kiln.heads.medusa_train import (
    IGNORE,
    HeadRows,
    MedusaConfig,
    chosen_tokens,
    draft_vocabulary,
    rows_and_labels,
    score,
    train_heads,
    train_medusa,
)
from kiln.optimize.medusa_draft import build_draft_graph, save_draft_graph

HYDRA = MedusaConfig(num_heads=2, text_prompts=4, chat_prompts=4, prompt_tokens=16, new_tokens=12, epochs=3,
                     batch_rows=32, kind="hydra", draft_vocabulary=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(make_tiny_hf_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def rows(checkpoint):
    model = ReferenceModel.from_checkpoint(checkpoint)
    batches = [greedy_states(model, [[5, 6, 7, 8], [9, 10, 11, 12, 13], [40, 41, 42]], 12)]
    return model, HeadRows(*rows_and_labels(batches, model, 2), chosen_tokens(batches))


def test_draft_vocabulary_is_the_most_chosen_tokens():
    chosen = torch.tensor([7, 3, 7, 9, 3, 7, 1])
    assert draft_vocabulary(chosen, 2).tolist() == [7, 3]
    assert draft_vocabulary(chosen, 10).tolist() == [7, 3, 1, 9]  # only tokens seen; ties: lower id first


def test_chosen_tokens_are_what_each_row_predicted(rows):
    model, data = rows
    head = lm_head_weight(model)
    assert torch.equal((data.x @ head.T).argmax(-1), data.chosen)  # greedy rows: the LM head's own argmax


def test_training_reads_the_token_before_and_is_deterministic(rows):
    model, data = rows
    head, embed = lm_head_weight(model), model.model.embed_tokens.weight
    config = dataclasses.replace(HYDRA, epochs=10, batch_rows=8, learning_rate=1e-2)
    first, _ = train_heads(data, head, config, lambda _m: None, embed=embed)
    second, _ = train_heads(data, head, config, lambda _m: None, embed=embed)
    assert isinstance(first, HydraHeads) and torch.equal(first.token_weight, second.token_weight)
    torch.manual_seed(config.seed)
    fresh = HydraHeads(2, first.vocab, embed, head)  # where training started
    assert not torch.allclose(first.token_weight, fresh.token_weight)  # the token before is an input training uses
    assert score(first, *data[:2], head, data.chosen)["mean_accepted_tokens"] > \
        score(fresh, *data[:2], head, data.chosen)["mean_accepted_tokens"]
    with pytest.raises(ValueError, match="token each row chose"):
        train_heads(HeadRows(data.x, data.labels), head, config, lambda _m: None, embed=embed)


def test_score_runs_the_chain_free_from_the_chosen_token(rows):
    """Head 2 is scored on head 1's own guess, not on the true token: a chain right at head 2 only."""
    model, data = rows
    heads = HydraHeads(2, torch.arange(64), model.model.embed_tokens.weight, lm_head_weight(model))
    guesses = heads.guess(data.x, data.chosen)
    labels = torch.stack([torch.full_like(data.chosen, -5), guesses[:, 1]], 1)  # head 1 never right
    result = score(heads, data.x, labels, lm_head_weight(model), data.chosen)
    assert result["top1_accuracy"] == [0.0, 1.0] and result["mean_accepted_tokens"] == 1.0


def test_hydra_artifact_round_trip_and_refusals(checkpoint, tmp_path):
    artifact = train_medusa(checkpoint, tiny_text(), dataclasses.replace(HYDRA, epochs=1))
    assert artifact.kind == "hydra" and artifact.info["kind"] == "hydra"
    out = artifact.save(tmp_path / "heads")
    loaded = MedusaArtifact.load(out)
    assert loaded.spec().kind == "hydra" and loaded.spec().num_heads == 2
    heads, vocab = loaded.hydra_arrays()
    hidden = checkpoint.spec.hidden_size
    assert len(heads) == 2 and [a.shape for a in heads[0]] == [(hidden, hidden), (hidden, hidden), (hidden,),
                                                                (hidden, hidden)]
    assert vocab.dtype == np.int64 and 0 < len(vocab) <= 64
    with pytest.raises(MedusaError, match="not Medusa heads"):
        loaded.heads()
    from safetensors.torch import save_file

    save_file({k: v for k, v in artifact.tensors.items() if k != "hydra.vocab"}, str(out / "medusa_heads.safetensors"))
    with pytest.raises(MedusaError, match="draft vocabulary"):
        MedusaArtifact.load(out)


def _numpy_chain(heads, vocab, embed, lm_head, hidden, tokens):
    index = {int(t): i for i, t in enumerate(vocab)}
    table = np.concatenate([embed[vocab], np.zeros((1, embed.shape[1]), np.float32)])
    out, confidence = [], []
    for state, token in zip(hidden, tokens, strict=True):
        row, guesses, probabilities = index.get(int(token), len(vocab)), [], []
        for a, b, bias, c in heads:
            pre = a @ state + b @ table[row] + bias
            state = state + c @ (pre / (1 + np.exp(-pre)))
            logits = lm_head[vocab] @ state
            row = int(logits.argmax())
            guesses.append(int(vocab[row]))
            probabilities.append(1 / np.exp(logits - logits.max()).sum())
        out.append(guesses)
        confidence.append(probabilities)
    return np.array(out), np.array(confidence)


def test_draft_graph_matches_numpy_and_the_torch_heads(rows, tmp_path):
    model, data = rows
    head, embed = lm_head_weight(model), model.model.embed_tokens.weight
    trained, _ = train_heads(data, head, dataclasses.replace(HYDRA, epochs=5, learning_rate=1e-2), lambda _m: None,
                             embed=embed)
    with torch.no_grad():  # trained heads on a random model are small: make each term matter
        for p in (trained.state_weight, trained.token_weight, trained.bias, trained.out_weight):
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    artifact = MedusaArtifact(trained.state(), {"num_heads": 2, "hidden_size": head.shape[1], "kind": "hydra"})
    arrays, vocab = artifact.hydra_arrays()
    e, h = embed.detach().numpy(), head.detach().numpy()
    path = save_draft_graph(build_draft_graph(arrays, vocab, e, h), tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = data.x.numpy()
    outside = next(t for t in range(e.shape[0]) if t not in set(vocab.tolist()))
    tokens = data.chosen.numpy().copy()
    tokens[::5] = outside  # a token outside the draft vocabulary reads the zero embedding
    got, confidence = session.run(["draft_tokens", "draft_confidence"], {"hidden": x, "token": tokens})
    want, want_confidence = _numpy_chain(arrays, vocab, e, h, x, tokens)
    # the graph's LM-head rows are 8-bit: a guess may flip only where the top two logits nearly tie
    assert got.shape == want.shape == (len(x), 2) and (got == want).mean() >= 0.9
    same = (got == want).all(1)  # where the chains agree, so do their guesses' probabilities (8-bit weights)
    error = np.abs(confidence[same] - want_confidence[same])
    assert confidence.shape == (len(x), 2) and error.max() < 0.1 and error.mean() < 0.02
    assert ((confidence > 0) & (confidence <= 1)).all() and confidence.std() > 0.01
    assert (got == trained.guess(data.x, torch.from_numpy(tokens)).numpy()).mean() >= 0.9
    assert set(np.unique(got)) <= set(vocab.tolist())
    assert IGNORE not in got
