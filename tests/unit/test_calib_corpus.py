"""The calibration corpus: Debian's r-cran-janeaustenr, read without R; fixed, disjoint splits."""

from __future__ import annotations

import pytest

from kiln.calibration import corpus


def _corpus_or_skip():
    try:
        corpus._data_dir()
    except corpus.CorpusNotFound as exc:
        pytest.skip(str(exc))


def test_corpus_splits_are_fixed_disjoint_real_text():
    _corpus_or_skip()
    cal, ev = corpus.calibration_text(), corpus.evaluation_text()
    assert cal.startswith("SENSE AND SENSIBILITY")
    assert ev.startswith("Persuasion")
    assert len(cal.split()) > 100_000 and len(ev.split()) > 80_000
    assert "Elinor" in cal and "Elinor" not in ev and "Anne Elliot" in ev
    assert corpus.evaluation_text() == ev  # deterministic
    assert "\n\n" in ev and all(len(p) for p in ev.split("\n\n")[:50])


def test_missing_corpus_names_the_install_step(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(corpus, "_DATA_SUBDIR", corpus.Path("no/such/dir"))
    with pytest.raises(corpus.CorpusNotFound, match="make install"):
        corpus.load_book("persuasion")
    with pytest.raises(ValueError, match="unknown book"):
        corpus.load_book("ulysses")
