"""Sizing the KV pool (model_runner.choose_num_blocks) and the served max_model_len (loader): sizes
that could never serve a max-length sequence, or that memory cannot back, are refused in one sentence."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidParamError
from kiln.runtime.loader import served_max_model_len
from kiln.runtime.model_runner import KvBudget, choose_num_blocks, fit_num_blocks, short_context_warning

GIB = 1 << 30
# 1 KiB per block of 16 tokens; one 2,048-token sequence is 128 blocks = 128 KiB; 64 of them 8 MiB
BUDGET = KvBudget(bytes_per_block=1024, block_size=16, min_tokens=2048, max_useful_tokens=64 * 2048)


def test_explicit_bytes_are_used_as_given():
    assert choose_num_blocks(BUDGET, 1 << 20, None, available=GIB) == 1024


def test_explicit_bytes_larger_than_memory_are_refused():
    with pytest.raises(InvalidParamError, match=r"^kv_cache_bytes 2,147,483,648 is more than the available memory "
                                                r"\(1,073,741,824 bytes\); lower it$") as err:
        choose_num_blocks(BUDGET, 2 * GIB, None, available=GIB)
    assert err.value.param == "kv_cache_bytes"


@pytest.mark.parametrize("kv_bytes", [1, 1023, 127 * 1024])
def test_explicit_bytes_below_one_max_length_sequence_are_refused(kv_bytes):
    with pytest.raises(InvalidParamError, match=r"one sequence of max_model_len 2048 tokens needs 131,072 bytes; "
                                                r"raise it or lower max_model_len$") as err:
        choose_num_blocks(BUDGET, kv_bytes, None, available=GIB)
    assert err.value.param == "kv_cache_bytes" and str(err.value).startswith(f"kv_cache_bytes {kv_bytes:,} holds ")


def test_exactly_one_sequence_is_enough():
    assert choose_num_blocks(BUDGET, 128 * 1024, None, available=GIB) == 128


def test_a_fraction_too_small_for_one_sequence_is_refused():
    assert choose_num_blocks(BUDGET, None, 0.5, available=GIB) == GIB // 2 // 1024
    with pytest.raises(InvalidParamError, match=r"^kv_cache_fraction 0.1 of the available memory holds 1552 tokens"):
        choose_num_blocks(BUDGET, None, 0.1, available=1_000_000)


def test_the_default_is_a_tenth_of_memory_capped_and_raised_to_one_sequence():
    assert choose_num_blocks(BUDGET, None, None, available=GIB) == 8 * 1024  # capped: 64 sequences
    assert choose_num_blocks(BUDGET, None, None, available=4 << 20) == 409  # a tenth of 4 MiB
    assert choose_num_blocks(BUDGET, None, None, available=400_000) == 128  # raised to one sequence
    with pytest.raises(InvalidParamError, match=r"more than the available memory \(100,000 bytes\); lower "
                                                r"max_model_len$") as err:
        choose_num_blocks(BUDGET, None, None, available=100_000)
    assert err.value.param == "max_model_len"


def test_max_model_len_may_lower_the_engine_limit_but_not_raise_it():
    assert served_max_model_len(2048, None) == 2048
    assert served_max_model_len(2048, 512) == 512
    with pytest.raises(InvalidParamError, match=r"^max_model_len 4096 exceeds the engine's max_seq_len 2048; "
                                                r"rebuild the engine with --max-seq-len 4096"):
        served_max_model_len(2048, 4096)


# The default max_model_len (the engine's max_seq_len): a pool too small for one such sequence serves what it holds.
def test_a_default_context_is_bounded_by_explicit_settings():
    assert fit_num_blocks(BUDGET, 1 << 20, None, available=GIB) == 1024  # holds 16k tokens: the full 2048 served
    assert short_context_warning(BUDGET, 1024) is None
    assert fit_num_blocks(BUDGET, 64 * 1024, None, available=GIB) == 64  # 1024 tokens: served shorter, and said
    assert short_context_warning(BUDGET, 64) == (
        "the KV pool (0.1 MiB) holds 1024 tokens, fewer than one sequence of the engine's context needs (2048 tokens, "
        "131,072 bytes): serving sequences of up to 1024 tokens; pass --kv-cache-bytes 131072 (or more) to serve the "
        "full context, or --max-model-len to choose a shorter one")
    assert fit_num_blocks(BUDGET, None, 0.5, available=100_000) == 48


def test_a_default_pool_grows_to_one_full_sequence_within_half_the_memory():
    assert fit_num_blocks(BUDGET, None, None, available=GIB) == 8 * 1024  # capped: 64 sequences
    assert fit_num_blocks(BUDGET, None, None, available=400_000) == 128  # raised to one sequence (a third of memory)
    assert fit_num_blocks(BUDGET, None, None, available=200_000) == 97  # half the memory: 1552 tokens served
    assert "holds 1552 tokens" in (short_context_warning(BUDGET, 97) or "")


@pytest.mark.parametrize("kv_bytes, fraction, available, param", [
    (1023, None, GIB, "kv_cache_bytes"), (None, 0.001, 1_000_000, "kv_cache_fraction"),
    (None, None, 2000, "max_model_len"),
])
def test_a_pool_without_one_block_is_refused(kv_bytes, fraction, available, param):
    with pytest.raises(InvalidParamError, match=r"holds no block of 16 tokens \(1,024 bytes\); a KV pool needs at "
                                                r"least one$") as err:
        fit_num_blocks(BUDGET, kv_bytes, fraction, available=available)
    assert err.value.param == param


def test_blocks_are_released_only_when_every_layer_slides():
    import dataclasses

    from kiln.runtime.loader import kv_release_window
    from kiln.spec import ModelSpec

    spec = ModelSpec("mistral", 320, 64, 128, 2, 4, 2, 16, 1e-5, 1e4, 2048, True, sliding_window=16)
    assert kv_release_window(spec) == 16
    assert kv_release_window(dataclasses.replace(spec, sliding_window=0)) == 0
    mixed = dataclasses.replace(spec, layer_types=("sliding_attention", "full_attention"))  # Gemma 2/3
    assert kv_release_window(mixed) == 0
    assert kv_release_window(dataclasses.replace(mixed, layer_types=("sliding_attention",) * 2)) == 16
