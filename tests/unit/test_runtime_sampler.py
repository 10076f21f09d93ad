"""Sampler vs a plain per-row numpy reference; seeds; logprobs; SamplingParams validation."""

from collections import Counter

import numpy as np
import pytest

from kiln.runtime.params import GREEDY_BELOW, RuntimeConfig, SamplingParams
from kiln.runtime.sampler import RowSettings, Sampler, apply_penalties, filtered_probs, sample
from kiln.runtime.sequence import Sequence

V = 50


def make_seq(params, prompt=(1, 2, 3, 3), output=(), seed_rng=None) -> Sequence:
    seq = Sequence(list(prompt), params)
    for t in output:
        seq.append(t)
    return seq


def reference_probs(logits, params, prompt, output):
    """The textbook definition, one row at a time, in float64."""
    x = logits.astype(np.float64).copy()
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    x = x / params.temperature
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    if params.min_p > 0:
        x[p < params.min_p * p.max()] = -np.inf
    if params.top_k > 0:
        x[np.argsort(-x)[params.top_k:]] = -np.inf
    if params.top_p < 1:
        p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        keep, mass = [], 0.0
        for t in np.argsort(-p):
            keep.append(t)
            mass += p[t]
            if mass >= params.top_p:
                break
        mask = np.full(V, -np.inf)
        mask[keep] = 0
        x = x + mask
    e = np.exp(x - x.max())
    return e / e.sum()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.8),
    SamplingParams(temperature=1.0, frequency_penalty=0.7),
    SamplingParams(temperature=1.0, presence_penalty=-0.9),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.02, repetition_penalty=1.2,
                   frequency_penalty=0.3, presence_penalty=0.4),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p)[15:80])
def test_distribution_matches_reference(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, size=(3, V)).astype(np.float32)
    prompts = [(1, 2, 3, 3), (4, 5), (6,)]
    outputs = [(7, 7, 8), (), (1, 9, 9, 9)]
    seqs = [make_seq(params, p, o) for p, o in zip(prompts, outputs, strict=True)]
    got = filtered_probs(apply_penalties(logits.copy(), seqs), seqs)
    for row in range(3):
        want = reference_probs(logits[row], params, prompts[row], outputs[row])
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("params", CASES[:4], ids=lambda p: repr(p)[15:80])
def test_sampled_token_is_inverse_cdf_of_the_sequence_generator(params):
    logits = np.random.default_rng(1).normal(0, 2, size=(1, V)).astype(np.float32)
    params = SamplingParams(**{**params.__dict__, "seed": 123})
    want = reference_probs(logits[0], params, (1, 2, 3, 3), ())
    u = np.random.default_rng([123, 0]).random()  # the seeded generator of sample index 0
    expected = int(np.searchsorted(np.cumsum(want), u * want.sum()))
    got = Sampler()(logits, [make_seq(params)]).token_ids[0]
    assert got == expected


def test_empirical_frequencies_follow_the_distribution():
    logits = np.random.default_rng(2).normal(0, 1, size=(1, 8)).astype(np.float32)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_k=4, seed=i), prompt=(0,)) for i in range(4000)]
    tokens = Sampler()(np.repeat(logits, len(seqs), axis=0), seqs).token_ids
    counts = np.bincount(tokens, minlength=8) / len(seqs)
    p = np.exp(logits[0]) * (np.argsort(np.argsort(-logits[0])) < 4)
    np.testing.assert_allclose(counts, p / p.sum(), atol=0.03)


def test_greedy_is_argmax_after_penalties():
    logits = np.zeros((2, V), dtype=np.float32)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    plain = make_seq(SamplingParams(temperature=0), prompt=(5,))
    penalized = make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(5,))
    assert Sampler()(logits, [plain, penalized]).token_ids.tolist() == [5, 6]


@pytest.mark.parametrize("temperature", [7.35e-187, 1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """Found by the server fuzz test: 1 / 7e-187 overflowed the sampler's float32 and the row sampled no token
    (the tokenizer then failed the whole step). Below GREEDY_BELOW a request is greedy, as in vLLM."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, size=(2, V)).astype(np.float32)
    seqs = [make_seq(SamplingParams(temperature=temperature, seed=1)), make_seq(SamplingParams(temperature=0))]
    assert seqs[0].params.greedy
    tokens = Sampler()(logits, seqs).token_ids.tolist()
    assert tokens == np.argmax(logits, axis=1).tolist()
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e300])
def test_an_extreme_repetition_penalty_still_samples(penalty):
    """A penalty far from 1 (valid: > 0) saturates the penalised logits at float32's largest finite value instead
    of making them infinite, which left the row unsampleable and failed the engine step."""
    logits = np.random.default_rng(2).normal(0, 2, size=(1, V)).astype(np.float32)
    logits[0, 3] = 4.0  # the one seen token (the prompt holds 1, 2, 3) with a positive logit
    logits[0, 1:3] = -1.0
    seq = make_seq(SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=5))
    token = Sampler()(logits, [seq]).token_ids[0]
    if penalty < 1:  # the seen positive logit grew without bound: it is the only token left with any mass
        assert token == 3
    else:
        assert 0 <= token < V


def test_seed_gives_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(3)
    steps = [rng.normal(0, 1, size=(4, V)).astype(np.float32) for _ in range(6)]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = make_seq(p)
    batched = make_seq(p)
    others = [make_seq(SamplingParams(temperature=0.7)), make_seq(SamplingParams(temperature=0)),
              make_seq(SamplingParams(temperature=1.3, top_k=3, seed=1))]
    sampler = Sampler()
    for logits in steps:
        a = sampler(logits[:1], [alone]).token_ids[0]
        b = sampler(logits[[1, 2, 0, 3]], [others[0], others[1], batched, others[2]]).token_ids[2]
        assert a == b
    unseeded = [Sampler()(steps[0][:1], [make_seq(SamplingParams(temperature=5.0))]).token_ids[0] for _ in range(20)]
    assert len(set(unseeded)) > 1


def test_logprobs_and_ranks():
    logits = np.random.default_rng(4).normal(0, 2, size=(2, V)).astype(np.float32)
    seqs = [make_seq(SamplingParams(temperature=0, logprobs=3)), make_seq(SamplingParams(temperature=0, logprobs=0)),
            ]
    out = Sampler()(logits, seqs)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    top = out.top_logprobs[0]
    order = np.argsort(-ref[0])[:3]
    assert list(top) == [int(order[0]), int(order[1]), int(order[2])]  # greedy: sampled token is rank 1
    for rank, t in enumerate(order, start=1):
        assert top[int(t)][1] == rank
        assert top[int(t)][0] == pytest.approx(ref[0, t], abs=1e-5)
    assert list(out.top_logprobs[1]) == [int(np.argmax(ref[1]))]
    assert out.sampled_logprobs[1] == pytest.approx(ref[1].max(), abs=1e-5)


def test_logprob_rank_of_an_unlikely_sampled_token():
    logits = np.array([[0.0, 5.0, 4.0, 3.0]], dtype=np.float32)
    seq = make_seq(SamplingParams(temperature=1.0, logprobs=1, repetition_penalty=100.0), prompt=(1, 2, 3))
    out = Sampler()(logits, [seq])
    token = int(out.token_ids[0])
    assert out.top_logprobs[0][token][1] == 4 - int(np.argsort(np.argsort(logits[0]))[token])


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("max_tokens", 0),
    ("stop", ("",)), ("stop_token_ids", (-1,)), ("logprobs", -1), ("logprobs", 21),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be") as err:
        SamplingParams(**{field: value})
    assert err.value.param == field  # what the server reports as OpenAI's error param


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
def test_nan_sampling_param_is_named_not_finite(field):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number, got nan") as err:
        SamplingParams(**{field: float("nan")})
    assert err.value.param == field


def test_temperature_message_and_stop_normalization():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("kv_cache_fraction", 1.5), ("num_threads", 0)])
def test_invalid_runtime_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be") as err:
        RuntimeConfig(**{field: value})
    assert err.value.param == field


# -- partial selection against a full sort ----------------------------------------------------


def full_sort_probs(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters as the sampler used to compute them: sort the whole row (float64)."""
    x = row.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if min_p > 0:
        x = np.where(p < min_p * p.max(), -np.inf, x)
    desc = np.sort(x)[::-1]
    if top_k > 0:
        x = np.where(x >= desc[min(top_k, len(x)) - 1], x, -np.inf)
    if top_p < 1:
        desc = np.sort(x)[::-1]
        p_desc = np.exp(desc - desc[0])
        p_desc /= p_desc.sum()
        before = np.cumsum(p_desc) - p_desc
        x = np.where(x >= desc[np.count_nonzero(before < top_p) - 1], x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def check_against_full_sort(logits: np.ndarray, params: list[SamplingParams]) -> None:
    seqs = [make_seq(p) for p in params]
    got = filtered_probs(logits, seqs)
    for row, p in enumerate(params):
        want = full_sort_probs(logits[row], p.temperature, p.top_k, p.top_p, p.min_p)
        np.testing.assert_array_equal(got[row] > 0, want > 0, err_msg=f"kept tokens differ for {p}")
        np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-12)


FILTERS = [
    dict(top_k=50), dict(top_k=1), dict(top_p=0.9), dict(top_p=0.5, top_k=40), dict(min_p=0.05),
    dict(top_k=50, min_p=0.05), dict(top_p=0.95, min_p=0.01), dict(top_k=300, top_p=0.8, min_p=0.001),
    dict(top_k=5000), dict(top_k=10**6), dict(top_k=20, top_p=1.0), dict(top_p=0.999999),
]


@pytest.mark.parametrize("vocab", [49152, 32000, 1000])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_partial_selection_equals_a_full_sort(vocab, scale):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, scale, size=(len(FILTERS), vocab)).astype(np.float32)
    temps = [0.7, 1.0, 1.3]
    params = [SamplingParams(temperature=temps[i % 3], **f) for i, f in enumerate(FILTERS)]
    check_against_full_sort(logits, params)


def test_ties_at_the_cuts_are_kept():
    rng = np.random.default_rng(5)
    logits = np.round(rng.normal(0, 1, size=(4, 20000)) * 2).astype(np.float32) / 2  # many ties everywhere
    params = [SamplingParams(top_k=10), SamplingParams(top_k=3000), SamplingParams(top_p=0.3),
              SamplingParams(top_p=0.9, min_p=0.2)]
    check_against_full_sort(logits, params)
    flat = np.zeros((2, 5000), dtype=np.float32)  # every token tied: any cut keeps the whole row
    check_against_full_sort(flat, [SamplingParams(top_k=7), SamplingParams(top_p=0.1)])


def test_tiny_vocabularies():
    rng = np.random.default_rng(6)
    for vocab in (1, 2, 3, 17):
        logits = rng.normal(0, 2, size=(len(FILTERS), vocab)).astype(np.float32)
        check_against_full_sort(logits, [SamplingParams(**f) for f in FILTERS])


def test_nuclei_of_every_width_and_temperature():
    """top_p's cut is found in one histogram bin of the weights by distance from the max: nuclei of
    one token, of most of a flat row (the cut deep in the bins), past the last bin (tiny temperature:
    the far tokens share it), and with min_p / top_k before it."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 0.3, size=(6, 49152)).astype(np.float32)  # flat: the 0.9 nucleus holds ~40k tokens
    logits[2] = rng.normal(0, 8, size=49152)  # peaked
    logits[3, 123] = 50.0  # one token holds nearly all the mass
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, min_p=0.5), SamplingParams(top_p=0.9),
              SamplingParams(top_p=0.99), SamplingParams(temperature=0.01, top_p=0.999999),
              SamplingParams(temperature=5.0, top_p=0.95, top_k=30000)]
    check_against_full_sort(logits, params)


def test_top_p_cuts_on_a_rounding_boundary_match_the_float64_reference():
    """A top_p within 1e-12..1e-10 of the head token's share: float64 tells the sides apart, the kernel's
    float32 pass (weights within ~1e-7) cannot, so its error bound must send the row to the float64 pass."""
    rng = np.random.default_rng(13)
    logits = rng.normal(-12, 2, size=49152).astype(np.float32)
    logits[[10, 20000, 40000]] = [np.log(3.0), 0.0, np.log(0.5)]
    x = logits.astype(np.float64)
    w = np.exp(x - x.max())
    first = w[10] / w.sum()  # the head token's share: the nucleus is it alone below, more above
    for top_p in (first - 1e-12, first + 1e-12, first - 1e-10, first + 1e-10):
        check_against_full_sort(logits[None], [SamplingParams(top_p=float(top_p))])


def reference_token(probs: np.ndarray, u: float) -> int:
    return int(np.searchsorted(np.cumsum(probs), u * probs.sum()))


@pytest.mark.parametrize("vocab", [49152, 1000, 100])
def test_sampled_tokens_are_the_inverse_cdf_of_the_filtered_distribution(vocab):
    rng = np.random.default_rng(8)
    kinds = [dict(), dict(top_k=50), dict(top_p=0.9), dict(top_k=50, min_p=0.05), dict(min_p=1e-6)]
    params = [SamplingParams(temperature=t, **k) for k in kinds for t in (0.6, 1.0)]
    logits = rng.normal(0, 2, size=(len(params), vocab)).astype(np.float32)
    seqs = [make_seq(p) for p in params]
    probs = filtered_probs(logits, seqs)
    for u in rng.random(size=(20, len(params))):
        got = sample(logits, RowSettings.of(seqs), u)
        assert got.tolist() == [reference_token(probs[i], u[i]) for i in range(len(params))]
    edges = sample(logits, RowSettings.of(seqs), np.zeros(len(params)))  # u = 0: the first token with mass
    assert edges.tolist() == [int(np.flatnonzero(p)[0]) for p in probs]


def test_a_row_samples_the_same_token_whatever_else_is_in_the_batch():
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 1, size=(6, 49152)).astype(np.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=50, min_p=0.05), SamplingParams(),
              SamplingParams(top_k=20000), SamplingParams(min_p=0.001), SamplingParams(top_p=0.3, top_k=5)]
    settings = RowSettings.of([make_seq(p) for p in params])
    u = rng.random(6)
    together = sample(logits, settings, u)
    for i in range(6):
        assert sample(logits[i:i + 1], settings.subset(np.array([i])), u[i:i + 1])[0] == together[i]


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_rows_on_several_threads_sample_what_one_thread_does(threads):
    """The step's rows split over threads (contiguous ranges, from 4 rows a thread) give the same thresholds and
    tokens, and a row that cannot be sampled is still named, lowest first, whichever range holds it."""
    from kiln.errors import KilnError
    from kiln.runtime.ops import sampling as kernels

    rng = np.random.default_rng(11)
    rows = 29  # ranges of unequal length
    logits = rng.normal(0, 2, size=(rows, 4099)).astype(np.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=50, min_p=0.05), SamplingParams(temperature=0.7),
              SamplingParams(top_p=0.5, temperature=1.3)] * 8
    settings = RowSettings.of([make_seq(p) for p in params[:rows]])
    columns = (settings.temperature, settings.top_k, settings.top_p, settings.min_p)
    u = rng.random(rows)
    one = kernels.sample_rows(logits, *columns, u, threads=1)
    many = kernels.sample_rows(logits, *columns, u, threads=threads)
    np.testing.assert_array_equal(many[0], one[0])
    np.testing.assert_array_equal(many[1], one[1])
    logits[[21, 26], 7] = np.nan  # in a later range than row 0's
    with pytest.raises(KilnError, match="logits row 21 cannot be sampled"):
        kernels.sample_rows(logits, *columns, u, threads=threads)


# -- penalties from incremental counts --------------------------------------------------------


def full_copy_penalties(logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
    """The penalties as the sampler used to apply them: dense counts from each sequence's token lists."""
    logits = logits.copy()
    for i, seq in enumerate(seqs):
        p = seq.params
        counts = np.bincount(np.asarray(seq.output_token_ids, dtype=np.int64), minlength=logits.shape[1])
        counts = counts.astype(np.float32)
        seen = counts > 0
        seen[np.asarray(seq.token_ids[: seq.num_prompt_tokens])] = True
        r = np.float32(p.repetition_penalty)
        row = np.where(seen, np.where(logits[i] > 0, logits[i] / r, logits[i] * r), logits[i])
        logits[i] = row - (np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0))
    return logits


def test_incremental_penalty_counts_equal_counting_the_token_lists():
    rng = np.random.default_rng(10)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.5, presence_penalty=-0.4),
              SamplingParams(temperature=0), SamplingParams(repetition_penalty=0.7, frequency_penalty=-1.1)]
    seqs = [make_seq(p, prompt=tuple(rng.integers(0, V, size=7))) for p in params]
    assert seqs[2].token_counts is None  # no penalties: nothing is kept
    for _ in range(60):  # well past the counts' first buffer (16 distinct ids)
        logits = rng.normal(0, 2, size=(4, V)).astype(np.float32)
        got = apply_penalties(logits.copy(), seqs)
        np.testing.assert_array_equal(got, full_copy_penalties(logits, seqs))
        for seq in seqs:
            seq.append(int(rng.integers(0, V)))


def test_top_logprobs_of_a_large_vocabulary_match_a_full_sort():
    rng = np.random.default_rng(11)
    logits = np.round(rng.normal(0, 2, size=(3, 49152)) * 4).astype(np.float32) / 4  # ties among the best
    seqs = [make_seq(SamplingParams(temperature=1.0, logprobs=k, seed=k)) for k in (20, 1, 0)]
    out = Sampler()(logits, seqs)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    for row, k in enumerate((20, 1, 0)):
        token = int(out.token_ids[row])
        order = np.argsort(-logits[row], kind="stable")[:k]
        best = {int(t): r for r, t in enumerate(order, start=1)}
        top = out.top_logprobs[row]
        assert top[token][1] == int((logits[row] > logits[row, token]).sum()) + 1
        assert {t: rank for t, (_, rank) in top.items() if t in best} == best
        assert set(top) == set(best) | {token}
        for t, (lp, _) in top.items():
            assert lp == pytest.approx(ref[row, t], abs=1e-5)
        assert out.sampled_logprobs[row] == pytest.approx(ref[row, token], abs=1e-5)


# -- the op-library kernels' own contract ------------------------------------------------------


@pytest.mark.parametrize("column,value", [(slice(None), -np.inf), (5, np.nan), (37, np.nan), (37, np.inf)])
def test_kernel_names_a_row_it_cannot_sample(column, value):
    from kiln.errors import KilnError
    from kiln.runtime.ops import sampling as kernels

    logits = np.zeros((2, 40), dtype=np.float32)
    logits[1, column] = value  # columns 5 and 37: the kernel's 32-wide body and its tail
    one = np.ones(2)
    with pytest.raises(KilnError, match="logits row 1 cannot be sampled"):
        kernels.sample_rows(logits, one, np.full(2, 5), one, np.zeros(2), np.zeros(2))


def test_kernel_checks_shapes():
    from kiln.runtime.ops import sampling as kernels

    logits, one = np.zeros((2, 40), dtype=np.float32), np.ones(2)
    with pytest.raises(ValueError, match="one value per row"):
        kernels.sample_rows(logits, one[:1], np.zeros(2, dtype=np.int64), one, np.zeros(2), None)
    with pytest.raises(ValueError, match=r"k must be in \[1, 40\]"):
        kernels.top_tokens(logits[:1], 41)


@pytest.mark.parametrize("vocab", [49152, 3000, 7])
def test_top_tokens_equal_a_stable_full_sort(vocab):
    from kiln.runtime.ops import sampling as kernels

    rng = np.random.default_rng(12)
    logits = np.round(rng.normal(0, 2, size=(4, vocab)) * 2).astype(np.float32) / 2  # ties
    for k in sorted({1, min(5, vocab), min(20, vocab), vocab}):
        ids, values = kernels.top_tokens(logits, k)
        want = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(values, np.take_along_axis(logits, want, axis=1))


@pytest.mark.parametrize("vocab", [49152, 40])
def test_top_tokens_put_nans_after_every_number(vocab):
    from kiln.runtime.ops import sampling as kernels

    rng = np.random.default_rng(13)
    logits = rng.normal(0, 2, size=(3, vocab)).astype(np.float32)
    logits[0, [5, 37]] = np.nan  # the strided selection's body and tail
    logits[1] = np.nan  # nothing to order: the NaNs in vocabulary order
    logits[2, 1:] = np.nan  # one number, then NaNs
    for k in sorted({1, 5, vocab - 1, vocab}):
        ids, values = kernels.top_tokens(logits, k)
        want = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # numpy's sort also puts NaNs last
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(values, np.take_along_axis(logits, want, axis=1))


@pytest.mark.parametrize("column,value", [(slice(None), -np.inf), (5, np.nan), (37, np.nan), (37, np.inf)])
@pytest.mark.parametrize("logprobs", [None, 3])
def test_a_greedy_row_that_cannot_be_sampled_is_named(column, value, logprobs):
    # as a sampled row's is (test_kernel_names_a_row_it_cannot_sample): argmax alone would pick the NaN's id
    from kiln.errors import KilnError

    logits = np.zeros((2, 40), dtype=np.float32)
    logits[1, column] = value
    seqs = [make_seq(SamplingParams(temperature=0, logprobs=logprobs)) for _ in range(2)]
    with pytest.raises(KilnError, match="logits row 1 cannot be sampled"):
        Sampler()(logits, seqs)
    mixed = [seqs[0], make_seq(SamplingParams(temperature=1.0, seed=1)), seqs[1]]
    with pytest.raises(KilnError, match="logits row 2 cannot be sampled"):  # named by its row in the step
        Sampler()(np.concatenate([logits[:1], np.zeros((1, 40), np.float32), logits[1:]]), mixed)
