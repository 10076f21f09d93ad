"""Incremental detokenizer: byte-level BPE never emits partial characters; stop strings."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kiln.runtime.detokenizer import IncrementalDetokenizer

TEXT = "héllo 😀 世界, naïve café — ünïcödé 🎉🎉!"


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per byte (byte-level BPE without merges): every multi-byte char spans tokens."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|eos|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    return tok


def stream(tok, prompt: str, text: str, stop=(), skip_special_tokens=True):
    prompt_ids = tok.encode(prompt).ids
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens, stop)
    deltas = [detok.add(t) for t in tok.encode(text).ids]
    return detok, deltas


def test_multibyte_characters_are_emitted_whole(byte_tokenizer):
    detok, deltas = stream(byte_tokenizer, "Say: ", TEXT)
    assert "".join(deltas) == TEXT == detok.take(finished=True)
    assert detok.take(finished=True) == ""  # taken text is gone
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens completed no character
    assert "😀" in deltas


def test_special_tokens_are_skipped_or_kept(byte_tokenizer):
    eos = byte_tokenizer.token_to_id("<|eos|>")
    for skip, expected in ((True, "ab"), (False, "ab<|eos|>")):
        detok = IncrementalDetokenizer(byte_tokenizer, [], skip)
        for t in byte_tokenizer.encode("ab").ids + [eos]:
            detok.add(t)
        assert detok.take(finished=True) == expected


def test_stop_string_truncates_and_is_held_back(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [], True, ("世界",))
    shown = ""
    found = None
    for t in byte_tokenizer.encode(TEXT).ids:
        found = detok.find_stop(len(detok.add(t)))
        shown += detok.take(finished=found is not None)
        assert not shown.endswith("世")  # the stop string's prefix is never shown
        if found:
            break
    assert found == "世界"
    assert shown == "héllo 😀 "


def test_stop_string_spanning_tokens(byte_tokenizer):
    detok, deltas = stream(byte_tokenizer, "", "abc STOP def", stop=("STOP", "zz"))
    assert detok.find_stop(len("".join(deltas))) == "STOP"
    assert detok.take(finished=True) == "abc "


def test_taking_as_it_streams_holds_back_and_finds_a_stop_across_takes(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [], True, ("STOP",))
    shown, found = [], None
    for t in byte_tokenizer.encode("one two STOP three").ids:
        found = detok.find_stop(len(detok.add(t)))
        shown.append(detok.take(finished=found is not None))
        if found:
            break
    assert found == "STOP" and "".join(shown) == "one two "
    assert len(detok.pending) == 0
    assert all(len(s) <= 1 for s in shown)  # one new character a step, never the whole text again


def test_real_bpe_with_merges_roundtrip():
    """A tokenizer with merges (multi-char tokens) streams the same text as a full decode."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT * 3, "the quick brown fox jumps over the lazy dog " * 5], trainer)
    detok, deltas = stream(tok, "prompt text", TEXT + " the lazy dog")
    assert "".join(deltas) == TEXT + " the lazy dog"
