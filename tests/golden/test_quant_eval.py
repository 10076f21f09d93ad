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
