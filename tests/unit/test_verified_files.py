"""Engine files whose sha256 matched are not hashed again while unchanged; a changed, fresh or copied file is,
and a corrupted one is still refused (kiln/verified_files.py, through read_manifest)."""

from __future__ import annotations

import os
import shutil

import pytest

from kiln import verified_files
from kiln.manifest import EngineLoadError, read_manifest
from tests.unit.test_manifest import engine_dir  # noqa: F401 - the fixture

FILES = 4  # the fixture's engine files: model.onnx, model.onnx.data, tokenizer.json, tokenizer_config.json


@pytest.fixture
def hashed(monkeypatch, tmp_path_factory) -> list[str]:
    """The names of the files hashed, with a private cache dir (outside the engine dir, the fixture's tmp_path)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv(verified_files.VERIFY_ALL_ENV, raising=False)
    names: list[str] = []
    real = verified_files.sha256_file

    def counting(path):
        names.append(os.path.basename(path))
        return real(path)
    monkeypatch.setattr(verified_files, "sha256_file", counting)
    return names


def test_an_unchanged_file_is_hashed_once(engine_dir, hashed, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 0.0)
    read_manifest(engine_dir)
    read_manifest(engine_dir)
    assert len(hashed) == FILES
    assert verified_files.cache_path().is_file()


def test_a_file_changed_after_it_was_remembered_is_hashed_and_refused(engine_dir, hashed, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 0.0)
    read_manifest(engine_dir)
    data = engine_dir / "model.onnx.data"
    stat = data.stat()
    data.write_bytes(b"\1" * stat.st_size)  # same size; a rewrite in the same timestamp tick keeps the mtime:
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # any change of the identity must do
    with pytest.raises(EngineLoadError, match="model.onnx.data is corrupted"):
        read_manifest(engine_dir)
    assert hashed.count("model.onnx.data") == 2


def test_a_file_written_just_before_its_hash_is_not_remembered(engine_dir, hashed, monkeypatch):  # noqa: F811
    # the fixture wrote the files a moment ago, within RACY_SECONDS: a same-tick rewrite could hide behind them
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 3600.0)  # "a moment", however slow the host
    read_manifest(engine_dir)
    read_manifest(engine_dir)
    assert len(hashed) == 2 * FILES


def test_a_copy_is_hashed_again(engine_dir, hashed, monkeypatch, tmp_path_factory):  # noqa: F811
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 0.0)
    read_manifest(engine_dir)
    # copy2 keeps the mtimes; the inode and path are new
    copy = shutil.copytree(engine_dir, tmp_path_factory.mktemp("copy") / "engine")
    read_manifest(copy)
    assert len(hashed) == 2 * FILES


def test_verify_all_hashes_remembered_files(engine_dir, hashed, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 0.0)
    read_manifest(engine_dir)
    monkeypatch.setenv(verified_files.VERIFY_ALL_ENV, "1")
    read_manifest(engine_dir)
    assert len(hashed) == 2 * FILES


def test_an_unreadable_cache_costs_only_the_hash(engine_dir, hashed, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verified_files, "RACY_SECONDS", 0.0)
    verified_files.cache_path().write_text("{not json")
    read_manifest(engine_dir)
    read_manifest(engine_dir)
    assert len(hashed) == FILES
