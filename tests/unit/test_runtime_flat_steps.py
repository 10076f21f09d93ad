"""No per-step work grows with the output's length: counted (ids decoded, tokens merged, outputs
handed out) over hundreds to thousands of tokens, never timed."""

from fake_runner import CharTokenizer, make_fake_engine

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.params import SamplingParams
from kiln.runtime.server import formatting

SPECIAL = 0  # CharTokenizer-like id that decodes to nothing when special tokens are skipped


class CountingDecoder(CharTokenizer):
    """Records how many ids each decode call reads."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.reads.append(len(ids))
        kept = [i for i in ids if not (skip_special_tokens and i == SPECIAL)]
        return super().decode(kept, skip_special_tokens)


def test_detokenizer_window_stays_small_through_long_outputs_and_runs_of_skipped_tokens():
    decoder = CountingDecoder()
    detok = IncrementalDetokenizer(decoder, [5, 6, 7], skip_special_tokens=True)
    tokens = [SPECIAL if (i // 50) % 2 else 1 + i % 60 for i in range(3000)]  # runs of 50 skipped tokens
    text = "".join(detok.add(t) for t in tokens)
    reads = decoder.reads[:]
    assert text == decoder.decode(tokens)
    assert max(reads) <= 8  # the prefix window and the new token, never the output so far
    assert len(detok.ids) <= 8


def test_stream_formatter_merges_held_deltas_once():
    """Deltas without text (their logprobs wait for the next text) are merged when text comes, once."""
    merged_tokens = []
    merge = formatting.merge_completions

    def counting(parts: list[CompletionOutput]) -> CompletionOutput:
        merged_tokens.append(sum(len(p.token_ids) for p in parts))
        return merge(parts)

    fmt = formatting.ResponseFormatter(False, "cmpl-1", "fake", SamplingParams())

    def delta(text: str, token: int, finish: str | None = None) -> RequestOutput:
        sample = CompletionOutput(0, text, [token], None, None, finish)
        return RequestOutput("r", None, [1], [sample], finish is not None)

    try:
        formatting.merge_completions = counting
        assert fmt.chunks(0, delta("a", 1), False)[0]["choices"][0]["text"] == "a"
        n = 2000
        assert all(fmt.chunks(0, delta("", 2), False) == [] for _ in range(n))
        last = fmt.chunks(0, delta("b", 3, "length"), False)
    finally:
        formatting.merge_completions = merge
    assert last[0]["choices"][0]["text"] == "b" and last[0]["choices"][0]["finish_reason"] == "length"
    assert merged_tokens == [n + 1]


def test_each_engine_step_hands_out_only_what_is_new():
    engine = make_fake_engine(200, max_seq_len=700)
    engine.add_request("long", [3, 4, 5], SamplingParams(temperature=0.8, seed=1, max_tokens=600, ignore_eos=True))
    request = engine.requests["long"]
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            steps += 1
            (sample,) = out.outputs
            assert len(sample.token_ids) <= 1 and len(sample.text) <= 1
            assert len(request.pending[0].detok.ids) <= 8
    assert steps >= 600
