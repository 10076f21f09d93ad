"""The per-step token budget: what RuntimeConfig.max_num_tokens asks for, else a backend's default."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidParamError
from kiln.manifest import BACKEND_ORT_CPU, BACKEND_TENSORRT
from kiln.runtime.loader import step_token_budget


@pytest.mark.parametrize("threads,expected", [(1, 256), (2, 256), (4, 512), (8, 1024), (16, 2048), (64, 2048)])
def test_cpu_default_grows_with_threads_up_to_what_the_graph_was_built_for(threads, expected):
    assert step_token_budget(2048, None, BACKEND_ORT_CPU, threads) == expected


def test_cpu_default_never_exceeds_a_small_built_for_budget():
    assert step_token_budget(128, None, BACKEND_ORT_CPU, 2) == 128


def test_cpu_default_without_a_thread_count_counts_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert step_token_budget(2048, None, BACKEND_ORT_CPU, None) == 768


def test_a_gpu_engine_computes_its_whole_built_for_budget():
    assert step_token_budget(2048, None, BACKEND_TENSORRT, 2) == 2048


def test_an_asked_for_budget_is_taken_when_the_graph_allows_it():
    assert step_token_budget(2048, 100, BACKEND_ORT_CPU, 2) == 100
    assert step_token_budget(2048, 2048, BACKEND_TENSORRT, None) == 2048


def test_a_budget_beyond_the_built_for_one_is_refused_by_name():
    with pytest.raises(InvalidParamError, match="max_num_tokens 4096 is more than the 2048 tokens per step this "
                                                "engine was built for"):
        step_token_budget(2048, 4096, BACKEND_ORT_CPU, 2)
