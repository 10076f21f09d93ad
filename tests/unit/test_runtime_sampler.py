"""Sampler vs a plain per-row numpy reference; seeds; logprobs; SamplingParams validation."""

from collections import Counter

import numpy as np
import pytest

from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.sampler import Sampler, apply_penalties, filtered_probs
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
