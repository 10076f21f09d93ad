"""KILN_NUM_THREADS: the engine thread count where RuntimeConfig leaves num_threads unset."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidParamError
from kiln.runtime.loader import NUM_THREADS_ENV, threads_from_env


def test_unset_or_blank_leaves_onnxruntimes_default(monkeypatch):
    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    assert threads_from_env() is None
    monkeypatch.setenv(NUM_THREADS_ENV, " ")
    assert threads_from_env() is None


def test_a_positive_count_is_taken(monkeypatch):
    monkeypatch.setenv(NUM_THREADS_ENV, "3")
    assert threads_from_env() == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_anything_else_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(NUM_THREADS_ENV, value)
    with pytest.raises(InvalidParamError, match=f"KILN_NUM_THREADS must be a positive integer, got '{value}'"):
        threads_from_env()
