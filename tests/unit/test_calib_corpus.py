"""The mixed-domain corpus (prose, technical, code, chat) from Debian packages: fixed disjoint splits,
deterministic token windows, and the manifest every calibration artifact carries."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_CHAT_TEMPLATE, make_tiny_hf_model

from kiln import corpus
from kiln.calibration.artifact import CalibrationArtifact
from kiln.calibration.calibrate import CalibrationConfig, calibrate_windows, corpus_windows
from kiln.chat_template import ChatTemplate
from kiln.corpus import chat_mix
from kiln.corpus.windows import domain_windows
from kiln.errors import InvalidParamError
from kiln.export.checkpoint import load_checkpoint

TEMPLATE = ChatTemplate({"chat_template": TINY_CHAT_TEMPLATE})


def _corpus_or_skip():
    try:
        for source in corpus.SOURCES:
            source.root()
    except corpus.CorpusNotFound as exc:
        pytest.skip(str(exc))


def _encode(text: str) -> list[int]:
    """A deterministic stand-in tokenizer: one id per UTF-8 byte."""
    return list(text.encode("utf-8"))


def test_austen_books_read_without_r():
    _corpus_or_skip()
    cal, ev = corpus.calibration_text(), corpus.evaluation_text()
    assert cal.startswith("SENSE AND SENSIBILITY")
    assert ev.startswith("Persuasion")
    assert len(cal.split()) > 100_000 and len(ev.split()) > 80_000
    assert "Elinor" in cal and "Elinor" not in ev and "Anne Elliot" in ev
    assert "\n\n" in ev and all(len(p) for p in ev.split("\n\n")[:50])


def test_every_domain_has_every_split_and_the_evaluation_split_is_large_enough():
    _corpus_or_skip()
    docs = corpus.documents()
    assert len({d.name for d in docs}) == len(docs)
    for domain in ("prose", "technical", "code"):
        for split in corpus.SPLITS:
            assert any(d.domain == domain and d.split == split for d in docs), (domain, split)
    for domain in corpus.DOMAINS:  # >= 16 windows of 512 tokens: 8k tokens even at ~4 bytes a token
        windows = domain_windows(domain, "evaluation", _encode, 2048, 16, TEMPLATE).windows
        assert len(windows) == 16, domain


def _paragraphs(texts) -> set[str]:
    return {" ".join(p.split()) for t in texts for p in t.split("\n\n") if len(p.strip()) >= 200}


def test_calibration_validation_and_evaluation_splits_are_disjoint():
    _corpus_or_skip()
    docs = corpus.documents()
    by_split = {s: [d for d in docs if d.split == s] for s in corpus.SPLITS}
    names = {s: {d.name for d in ds} for s, ds in by_split.items()}
    assert not names["calibration"] & names["evaluation"]
    assert not names["calibration"] & names["validation"]
    assert not names["validation"] & names["evaluation"]
    # no long paragraph of a held-out split's text was calibrated on (stdlib modules share code)
    text = {s: _paragraphs(p.text for d in corpus.DOMAINS[:3] for p in corpus.split_passages(d, s))
            for s in corpus.SPLITS}
    assert not text["evaluation"] & text["calibration"]
    assert not text["validation"] & (text["calibration"] | text["evaluation"])
    # the windows, chat included, come from disjoint documents too
    for domain in corpus.DOMAINS:
        used = {s: set(domain_windows(domain, s, _encode, 512, 8, TEMPLATE).documents) for s in corpus.SPLITS}
        assert used["evaluation"] and used["calibration"]
        assert not used["evaluation"] & (used["calibration"] | used["validation"]), domain
        assert not used["calibration"] & used["validation"], domain
        assert used["evaluation"] <= names["evaluation"]


def test_corpus_windows_are_deterministic():
    _corpus_or_skip()
    for domain in corpus.DOMAINS:
        a = domain_windows(domain, "calibration", _encode, 1024, 8, TEMPLATE)
        b = domain_windows(domain, "calibration", _encode, 1024, 8, TEMPLATE)
        assert len(a.windows) == 8 and all(len(w) == 1024 for w in a.windows)
        assert a == b and corpus.token_digest(a.windows) == corpus.token_digest(b.windows)
        assert len(set(a.documents)) > 1, domain  # the passage order mixes documents from the first windows on
    # the windows are the start of the fixed passage stream, cut without overlap
    stream = [p.text + "\n\n" for p in corpus.split_passages("prose", "calibration")]
    ids = _encode("".join(stream[:20]))
    windows = domain_windows("prose", "calibration", _encode, 256, 6).windows
    assert windows == [ids[i * 256:(i + 1) * 256] for i in range(6)]


def test_chat_domain_renders_faq_questions_and_continuations_with_the_template():
    _corpus_or_skip()
    faq = next(d for d in corpus.documents() if d.name.startswith("debian-faq:"))
    pairs = chat_mix.faq_pairs(faq.text)
    assert len(pairs) > 50
    answers = dict(pairs)
    assert answers["Does Debian just do GNU/Linux?"].startswith("Currently, Debian is only available for Linux")
    convs = list(chat_mix.conversations("evaluation"))
    assert {c.document.split(":")[0] for c in convs[:3]} == {"janeaustenr", "debian-faq", "python3.13"}
    assert all([m["role"] for m in c.messages] == ["user", "assistant"] for c in convs)
    text = TEMPLATE.render(convs[0].messages, add_generation_prompt=False)
    assert "<|im_start|>user" in text and "<|im_start|>assistant" in text
    with pytest.raises(InvalidParamError, match="chat template"):
        domain_windows("chat", "evaluation", _encode, 64, 1, ChatTemplate({}))
    with pytest.raises(InvalidParamError, match="unknown corpus split"):
        domain_windows("prose", "test", _encode, 64, 1)


def test_missing_source_names_the_install_step(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(corpus, "AUSTEN", corpus.DebianSource("r-cran-janeaustenr", "no/such/file", "-"))
    with pytest.raises(corpus.CorpusNotFound, match="make install"):
        corpus.load_book("persuasion")
    with pytest.raises(ValueError, match="unknown book"):
        corpus.load_book("ulysses")


def test_calibration_artifact_records_its_corpus_manifest(tmp_path):
    _corpus_or_skip()
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, "llama"))
    config = CalibrationConfig("smoothquant", num_windows=8, window=64, rows_per_window=8, alpha=0.5)
    windows, manifest = corpus_windows(ck, config)
    assert len(windows) == 8 and all(len(w) == 64 for w in windows)
    assert list(manifest["domains"]) == list(corpus.DOMAINS)
    assert all(m["windows"] == 2 and m["tokens"] == 128 for m in manifest["domains"].values())
    assert manifest["split"] == "calibration"
    packages = {s["package"]: s for s in manifest["sources"]}
    assert set(packages) == {s.package for s in corpus.SOURCES}
    assert all(s["version"] and s["licence"] and s["deb_sha256"] for s in packages.values())
    assert corpus_windows(ck, config) == (windows, manifest)  # same sources, same windows
    artifact = calibrate_windows(ck, windows, config, corpus=manifest)
    loaded = CalibrationArtifact.load(artifact.save(tmp_path / "sq"))
    assert loaded.info["corpus"] == json.loads(json.dumps(manifest))
    # the windows are the manifest's: prose first, then technical, code, chat, in turn
    prose = manifest["domains"]["prose"]
    assert prose["token_sha256"] == corpus.token_digest([windows[0], windows[4]])


def test_calibration_text_file_or_dir_replaces_the_corpus(tmp_path):
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, "llama"))
    config = CalibrationConfig("smoothquant", num_windows=3, window=64, rows_per_window=8, alpha=0.5)
    own = tmp_path / "own"
    own.mkdir()
    (own / "a.txt").write_text("Domain words, about reactors and valves. " * 20)
    (own / "b.md").write_text("# Notes\n\nThe valve opens at 3 bar.\n\n" * 20)
    windows, manifest = corpus_windows(ck, config, own)
    assert len(windows) == 3 and list(manifest["domains"]) == ["user"]
    files = manifest["sources"][0]["files"]
    assert [f["path"] for f in files] == [str(own / "a.txt"), str(own / "b.md")]
    assert all(len(f["sha256"]) == 64 for f in files)
    single, _ = corpus_windows(ck, config, own / "a.txt")
    assert all(torch.tensor(w).max() < ck.spec.vocab_size for w in single)
    (own / "c.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidParamError, match="not UTF-8"):
        corpus_windows(ck, config, own)


def test_eval_options_name_the_split():
    from kiln.evaluation.evaluate import EvalOptions

    assert EvalOptions(split="validation").split == "validation"
    with pytest.raises(InvalidParamError, match="split must be one of"):
        EvalOptions(split="test")


def test_debian_sources_come_from_the_cache_with_their_recorded_version(tmp_path, monkeypatch):
    from kiln.corpus import debian

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    source = debian.DebianSource("kiln-test-pkg", "usr/share/doc/kiln-test-pkg/text", "CC0-1.0")
    fetched = []
    monkeypatch.setattr(debian, "_download", lambda packages: fetched.append(packages))
    with pytest.raises(debian.CorpusNotFound, match="kiln-test-pkg"):
        debian.fetch([source])  # the (stubbed) download put nothing there
    assert fetched == [["kiln-test-pkg"]]
    root = tmp_path / "corpus" / "kiln-test-pkg"
    (root / source.probe).parent.mkdir(parents=True)
    (root / source.probe).write_text("text")
    (root / debian.SOURCE_FILE).write_text(json.dumps({"version": "1.0-1", "deb_sha256": "ab" * 32}))
    assert debian.fetch([source]) == [root] and len(fetched) == 1  # cached: nothing downloaded
    assert source.record() == {"package": "kiln-test-pkg", "licence": "CC0-1.0", "version": "1.0-1",
                               "deb_sha256": "ab" * 32}
