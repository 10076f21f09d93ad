"""Speculative decoding over the fake model: n-gram lookup, greedy outputs identical to plain decoding
(staggered arrivals, preemption, prefix caching, n > 1, stops, logprobs), KV rollback invariants over
random schedules with random acceptance lengths, and the step's switch-off on large batches."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import FakeModelRunner, make_fake_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import InvalidParamError
from kiln.runtime.engine import Engine
from kiln.runtime.llm import LLM
from kiln.runtime.model_runner import RunnerOutput, build_batch
from kiln.runtime.outputs import merge_outputs
from kiln.runtime.params import HYDRA_MIN_GUESS_PROBABILITY, RuntimeConfig, SamplingParams, SpeculativeConfig
from kiln.runtime.speculative.medusa import MedusaProposer
from kiln.runtime.speculative.ngram import NgramProposer, lookup
from kiln.runtime.speculative.proposer import NO_PROPOSAL, Proposal, ProposalRequest, Proposer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class CopyingRunner(FakeModelRunner):
    """The fake model, biased to continue the latest earlier occurrence of its last token (as a language
    model quoting its input does), so n-gram proposals are often right - and sometimes wrong."""

    def logits_for(self, tokens: np.ndarray) -> np.ndarray:
        logits = super().logits_for(tokens)
        earlier = np.flatnonzero(tokens[:-1] == tokens[-1])
        if earlier.size and int(tokens.sum()) % 5:  # not always: some proposals must fail
            logits[tokens[earlier[-1] + 1]] += 8.0
        return logits


def engine(num_blocks=256, spec: SpeculativeConfig | None = None, caching=True, proposer=None,
           max_num_tokens=32) -> Engine:
    e = make_fake_engine(num_blocks, max_num_tokens=max_num_tokens, max_seq_len=96,
                         config=RuntimeConfig(enable_prefix_caching=caching, speculative=spec))
    e.runner = CopyingRunner(num_blocks, e.runner.block_size, e.runner.vocab_size)
    if proposer is not None:
        e.speculator.proposer = proposer
    return e


NGRAM = SpeculativeConfig("ngram", num_tokens=5, ngram_max=3, ngram_min=1, max_batch_tokens=64)


def prompts(k=12):
    """Prompts that repeat themselves, so an n-gram lookup finds matches."""
    out = []
    for i in range(k):
        motif = [(i * 11 + 3 * j) % 61 + 1 for j in range(4 + i % 5)]
        out.append((motif * 4)[: 6 + 3 * i] + [(i * 7) % 60 + 1])
    return out


def run_staggered(e: Engine, ps, params, every=2):
    """Add one prompt every `every` steps; check the block manager after each step; merged outputs."""
    deltas, finals = {}, {}
    pending = list(enumerate(ps))
    steps = 0
    while pending or e.has_unfinished():
        if pending and steps % every == 0:
            i, p = pending.pop(0)
            e.add_request(f"r{i}", p, params)
        for out in e.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                finals[out.request_id] = merge_outputs(deltas.pop(out.request_id))
        e.block_manager.check()
        steps += 1
    return [finals[f"r{i}"] for i in range(len(ps))]


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# -- n-gram lookup ------------------------------------------------------------------------------

def test_lookup_prefers_the_longest_ngram_and_its_latest_occurrence():
    t = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    assert lookup(t, 3, 1, 4) == (9, 2, 3, 8)  # "1 2 3" once before: what followed it
    assert lookup(t, 2, 1, 4) == (8, 7, 1, 2)  # "2 3": latest earlier occurrence at 4
    assert lookup(t, 3, 1, 2) == (9, 2)  # at most max_tokens
    assert lookup(np.array([5, 6, 7]), 3, 1, 4) == ()  # the suffix never matches itself
    assert lookup(np.array([4, 4]), 2, 1, 3) == (4,)  # a match at the end yields what is left
    assert lookup(np.array([1, 2, 3, 4]), 3, 2, 3) == ()  # below ngram_min nothing is tried


def test_proposer_returns_one_proposal_per_request():
    from kiln.runtime.sequence import Sequence

    seqs = [Sequence([1, 2, 1], GREEDY), Sequence([3, 4, 5], GREEDY)]
    got = NgramProposer(2, 1).propose([ProposalRequest(seqs[0], 3), ProposalRequest(seqs[1], 3)])
    assert got == [Proposal((2, 1)), NO_PROPOSAL]


def test_speculative_config_names_the_bad_field():
    with pytest.raises(InvalidParamError, match="speculative method must be one of"):
        SpeculativeConfig("lookahead")
    with pytest.raises(InvalidParamError, match="num_speculative_tokens must be in"):
        SpeculativeConfig("ngram", num_tokens=0)
    with pytest.raises(InvalidParamError, match="ngram_max must be >= ngram_min"):
        SpeculativeConfig("ngram", ngram_max=1, ngram_min=2)
    with pytest.raises(InvalidParamError, match="draft_engine must be given exactly when"):
        SpeculativeConfig("draft")
    with pytest.raises(InvalidParamError, match="draft_engine must be given exactly when"):
        SpeculativeConfig("ngram", draft_engine="x")
    with pytest.raises(InvalidParamError, match="speculative must be a SpeculativeConfig"):
        RuntimeConfig(speculative="ngram")  # type: ignore[arg-type]
    with pytest.raises(InvalidParamError, match=r"min_guess_probability must be in \[0, 1\)"):
        SpeculativeConfig("medusa", min_guess_probability=1.0)
    with pytest.raises(InvalidParamError, match="min_guess_probability must be None or 0 unless"):
        SpeculativeConfig("ngram", min_guess_probability=0.2)
    default = SpeculativeConfig("medusa")
    assert default.guess_probability(hydra=True) == HYDRA_MIN_GUESS_PROBABILITY > 0 == default.guess_probability(False)
    assert SpeculativeConfig("medusa", min_guess_probability=0).guess_probability(hydra=True) == 0


# -- the engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks, caching", [(256, True), (256, False), (24, True), (24, False)])
def test_greedy_ngram_is_token_identical_to_plain_decoding(num_blocks, caching):
    ps = prompts()
    reference = token_ids(run_staggered(engine(256), ps, GREEDY))
    e = engine(num_blocks, NGRAM, caching)
    got = run_staggered(e, ps, GREEDY)
    assert token_ids(got) == reference
    stats = e.stats()
    assert stats.num_spec_accepted_tokens > 0.3 * stats.num_spec_proposed_tokens > 0
    assert stats.num_generated_tokens == sum(len(t[0]) for t in reference)
    if num_blocks < 100:
        assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and not e.block_manager.owners


def test_speculation_saves_steps():
    ps = prompts(1)
    plain, spec = engine(), engine(spec=NGRAM)
    LLM(plain).generate(ps, GREEDY)
    LLM(spec).generate(ps, GREEDY)
    assert len(spec.runner.steps) < 0.7 * len(plain.runner.steps)


def test_stops_max_tokens_logprobs_and_n_work_with_several_tokens_per_step():
    ps = prompts(6)
    base = LLM(engine()).generate(ps, GREEDY)
    text = base[3].outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[9:11]]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       stop_token_ids=(base[2].outputs[0].token_ids[6],)),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
        SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    for params in cases:
        want = LLM(engine()).generate(ps, params)
        spec_engine = engine(spec=NGRAM)
        got = LLM(spec_engine).generate(ps, params)
        assert spec_engine.stats().num_spec_verifications > 0, params
        for w, g in zip(want, got, strict=True):
            for wc, gc in zip(w.outputs, g.outputs, strict=True):
                assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == \
                    (wc.token_ids, wc.text, wc.finish_reason, wc.stop_reason), params
                if params.logprobs is not None:
                    assert len(gc.logprobs) == len(gc.token_ids)
                    for a, b in zip(gc.logprobs, wc.logprobs, strict=True):
                        assert a.keys() == b.keys()
                        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)
                    assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-4)


def test_streamed_deltas_carry_several_tokens_per_step():
    e = engine(spec=NGRAM)
    e.add_request("a", prompts(1)[0], GREEDY)
    sizes = []
    while e.has_unfinished():
        sizes += [len(o.outputs[0].token_ids) for o in e.step()]
    assert sum(sizes) == GREEDY.max_tokens and max(sizes) > 1


def test_speculation_switches_off_when_the_batch_is_large():
    spec = SpeculativeConfig("ngram", num_tokens=4, ngram_min=1, max_batch_tokens=12)
    e = engine(spec=spec)
    ps = prompts(12)
    for i, p in enumerate(ps):
        e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while e.scheduler.waiting or any(s.num_uncomputed > 1 for s in e.scheduler.running):
        e.step()
    for _ in range(3):  # 12 decodes: no room under 12 tokens for any proposal
        out = e.scheduler.schedule()
        assert e.speculator.plan(out) is out and out.num_tokens == 12
        e._postprocess(out, RunnerOutput(e.runner.execute(build_batch(out))), None)
    for i in range(9):  # 3 left: 9 tokens of room, 3 proposals each at most
        e.abort(f"r{i}")
    out = e.speculator.plan(e.scheduler.schedule())
    assert out.num_tokens <= 12 and max(len(p) for p in out.proposals) <= 3
    assert any(out.proposals)


def test_batch_asks_logits_for_every_verified_row():
    e = engine(spec=NGRAM)
    e.add_request("a", prompts(1)[0], GREEDY)
    e.add_request("b", [5, 6, 7, 8, 9, 10], GREEDY)
    while not any(s.num_output_tokens > 3 for s in e.scheduler.running):
        e.step()
    out = e.speculator.plan(e.scheduler.schedule())
    batch = build_batch(out)
    expected, start = [], 0
    for (_seq, n), proposal in zip(out.scheduled, out.proposals, strict=True):
        start += n + len(proposal)
        expected += list(range(start - len(proposal) - 1, start))
    assert any(out.proposals)
    assert batch.logits_indices.tolist() == expected and batch.num_logits == len(expected)


# -- rollback under random schedules ------------------------------------------------------------

class OracleProposer(Proposer):
    """Proposes the reference continuation for a random number of tokens, then wrong ones: every
    acceptance length from 0 to k occurs."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], draws: list[int]) -> None:
        self.reference = reference
        self.draws = draws
        self.i = 0

    def propose(self, requests):
        out = []
        for r in requests:
            seq = r.seq
            truth = self.reference[tuple(seq.token_ids[: seq.num_prompt_tokens])][seq.num_output_tokens:]
            d = self.draws[self.i % len(self.draws)]
            self.i += 1
            right = min(d % (r.max_tokens + 1), len(truth))
            wrong = [(t + 1) % 64 for t in truth[right: r.max_tokens]]
            out.append(Proposal(tuple(truth[:right] + wrong)) if d % 7 else NO_PROPOSAL)
        return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(14, 40), max_num_tokens=st.integers(2, 24),
       k_every=st.tuples(st.integers(1, 6), st.integers(1, 4)), caching=st.booleans(),
       draws=st.lists(st.integers(0, 1000), min_size=1, max_size=30),
       lengths=st.lists(st.integers(2, 20), min_size=2, max_size=8))
def test_rollback_keeps_block_manager_invariants(num_blocks, max_num_tokens, k_every, caching, draws, lengths):
    """Every acceptance length from 0 to k, any budget, pool size (preemption) and arrival spacing."""
    k, every = k_every
    ps = [[(7 * i + 3 * j) % 60 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = token_ids(run_staggered(engine(256), ps, params))
    truth = {tuple(p): r[0] for p, r in zip(ps, reference, strict=True)}
    spec = SpeculativeConfig("ngram", num_tokens=k, max_batch_tokens=64)
    e = engine(num_blocks, spec, caching, OracleProposer(truth, draws), max_num_tokens=max_num_tokens)
    assert token_ids(run_staggered(e, ps, params, every)) == reference  # check() ran after every step
    bm = e.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owners


# -- the draft proposer -------------------------------------------------------------------------

def draft_engine(num_blocks, draft_runner, k=4, caching=True):
    from fake_runner import CharTokenizer

    from kiln.runtime.engine import EngineLimits
    from kiln.runtime.speculative.draft import DraftProposer

    spec = SpeculativeConfig("draft", num_tokens=k, draft_engine="(fake)", max_batch_tokens=64)
    config = RuntimeConfig(enable_prefix_caching=caching, speculative=spec)
    limits = EngineLimits(max_seq_len=96, max_num_tokens=32, eos_token_ids=(0,))
    return Engine(CopyingRunner(num_blocks, 4, 64), CharTokenizer(), config, limits,
                  proposer=DraftProposer(draft_runner))


@pytest.mark.parametrize("same_model", [True, False])
@pytest.mark.parametrize("sampled", [False, True])
def test_draft_proposer_keeps_outputs_and_its_pool_in_step(same_model, sampled):
    """A draft that is the target itself has every greedy guess kept; another model has some rejected,
    so its KV is rolled back. Greedy outputs equal plain decoding's; the draft pool ends empty."""
    ps = prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True) if sampled \
        else GREEDY
    draft_runner = (CopyingRunner if same_model else FakeModelRunner)(64, 4, 64)
    e = draft_engine(24, draft_runner)
    checked = []
    real_step = e.step

    def step():
        out = real_step()
        e.proposer.block_manager.check()
        checked.append(1)
        return out

    e.step = step
    got = run_staggered(e, ps, params)
    stats = e.stats()
    assert stats.num_spec_verifications > 0 and stats.num_preemptions > 0
    if not sampled:
        assert token_ids(got) == token_ids(run_staggered(engine(256), ps, params))
        if same_model:
            assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
        else:
            assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens
    else:
        assert all(len(o.outputs[0].token_ids) == 24 for o in got)
    bm = e.proposer.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not e.proposer.mirrors


# -- the Medusa proposer ------------------------------------------------------------------------

class MedusaRunner(CopyingRunner):
    """The copying fake model with K heads: head i at a row puts all its weight on the model's own greedy
    token i places after that row's, except in some contexts (a wrong guess there: proposals must fail)."""

    num_medusa_heads = 3

    def execute_all(self, batch):
        logits = self.execute(batch)
        rows = np.zeros(0, np.int64) if batch.medusa_indices is None else batch.medusa_indices
        heads = np.zeros((len(rows), self.num_medusa_heads, self.vocab_size), dtype=np.float32)
        self.head_rows = getattr(self, "head_rows", 0) + len(rows)
        for m, t in enumerate(rows.tolist()):
            chain = list(self.context(batch, t))
            for _ in range(self.num_medusa_heads + 1):
                chain.append(int(self.logits_for(np.array(chain)).argmax()))
            for i, guess in enumerate(chain[-self.num_medusa_heads:]):
                wrong = (len(chain) * 3 + i) % 5 == 0
                heads[m, i, (guess + 1) % self.vocab_size if wrong else guess] = 1.0
        return RunnerOutput(logits, heads)


MEDUSA = SpeculativeConfig("medusa", num_tokens=3, max_batch_tokens=64)


def medusa_engine(num_blocks=256, caching=True, max_rows=None, spec=MEDUSA) -> Engine:
    from fake_runner import CharTokenizer

    from kiln.runtime.engine import EngineLimits

    config = RuntimeConfig(enable_prefix_caching=caching, speculative=spec)
    limits = EngineLimits(max_seq_len=96, max_num_tokens=32, eos_token_ids=(0,))
    return Engine(MedusaRunner(num_blocks, 4, 64), CharTokenizer(), config, limits,
                  proposer=MedusaProposer(3, max_rows))


@pytest.mark.parametrize("num_blocks, caching, max_rows", [(256, True, None), (24, True, None), (24, False, None),
                                                          (256, True, 1)])
def test_medusa_greedy_is_token_identical_to_plain_decoding(num_blocks, caching, max_rows):
    """Staggered arrivals, preemption (24 blocks), prefix caching; block manager checked after each step."""
    ps = prompts()
    reference = token_ids(run_staggered(engine(256), ps, GREEDY))
    e = medusa_engine(num_blocks, caching, max_rows)
    assert token_ids(run_staggered(e, ps, GREEDY)) == reference
    stats = e.stats()
    # the heads are right 4 times in 5: most proposals are kept, not all
    assert 0.5 * stats.num_spec_proposed_tokens < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens
    if num_blocks < 100:
        assert stats.num_preemptions > 0
    assert not e.proposer.guesses  # released with their sequences


def test_medusa_heads_are_read_where_the_next_step_may_speculate():
    e = medusa_engine()
    LLM(e).generate(prompts(1), GREEDY)
    steps = e.runner.steps
    assert e.stats().num_spec_verifications > 0.5 * len(steps)  # the first decode already speculates
    assert e.runner.head_rows == sum(b.num_logits for b in steps)  # every verified row (max_rows None)
    limited = medusa_engine(max_rows=1)
    LLM(limited).generate(prompts(1), GREEDY)
    assert limited.runner.head_rows == len(limited.runner.steps)  # one row per step
    # 12 decodes leave no room for proposals under max_batch_tokens 12: no heads are computed either
    off = medusa_engine(spec=SpeculativeConfig("medusa", num_tokens=3, max_batch_tokens=12))
    LLM(off).generate(prompts(12), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert off.runner.head_rows < sum(b.num_logits for b in off.runner.steps)


def test_medusa_reads_the_heads_at_the_first_verified_row_by_default():
    """The measured-faster setting (docs/design.md, "Medusa heads"); None still reads every row."""
    assert MedusaProposer(3).medusa_rows(5) == 1 and MedusaProposer(3, None).medusa_rows(5) == 5


def test_medusa_proposes_only_from_heads_of_the_latest_token():
    from kiln.runtime.sequence import Sequence

    proposer = MedusaProposer(3)
    seq = Sequence([1, 2, 3], GREEDY)
    heads = np.zeros((2, 3, 8), np.float32)
    heads[1, [0, 1, 2], [5, 6, 7]] = 1.0
    proposer.observe([seq], [1], {"medusa_logits": heads})
    assert proposer.propose([ProposalRequest(seq, 2)]) == [Proposal((5, 6))]  # k = min(K, max_tokens)
    seq.append(4)  # a token chosen by a row without heads: the guesses followed another prefix
    assert proposer.propose([ProposalRequest(seq, 3)]) == [NO_PROPOSAL]
    proposer.release(seq)
    assert not proposer.guesses


def test_medusa_chains_stop_where_the_heads_doubt_them():
    """min_guess_probability: a chain is proposed as far as the product of its heads' top probabilities
    stays >= the threshold (heads' top probabilities here 0.88, 0.5 (a tie: argmax picks the first), ~1)."""
    from kiln.runtime.sequence import Sequence

    heads = np.full((1, 3, 8), -30.0, np.float32)
    heads[0, 0, [5, 4]] = [5.0, 3.0]
    heads[0, 1, [2, 6]] = [5.0, 5.0]
    heads[0, 2, 7] = 10.0
    for threshold, want in ((0.0, (5, 2, 7)), (0.4, (5, 2, 7)), (0.6, (5,)), (0.9, ())):
        proposer = MedusaProposer(3, min_probability=threshold)
        seq = Sequence([1, 2, 3], GREEDY)
        proposer.observe([seq], [0], {"medusa_logits": heads})
        assert proposer.propose([ProposalRequest(seq, 3)]) == [Proposal(want)], threshold


def test_medusa_serves_sampled_requests():
    """One-hot proposals, as ngram's: verify's rejection sampling (tests/unit/test_speculative_sampling.py)
    keeps the target's distribution; here sampled requests run to their length with proposals kept."""
    params = SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=3)
    e = medusa_engine(24)
    got = run_staggered(e, prompts(6), params)
    assert all(len(o.outputs[0].token_ids) == 20 for o in got)
    assert e.stats().num_spec_accepted_tokens > 0 and e.stats().num_preemptions > 0


def test_a_request_whose_verification_fails_fails_alone(monkeypatch):
    """A verification that raises (a bug, or settings it cannot handle) ends its request only: the others
    keep their speculative output, and every block comes back."""
    import kiln.runtime.speculative.speculator as engine_module

    ps = prompts(6)
    expected = run_staggered(engine(spec=NGRAM), ps[1:], GREEDY)
    real_verify = engine_module.verify

    def verify(seq, logits, proposal):
        if seq.token_ids[:seq.num_prompt_tokens] == ps[0]:
            raise IndexError("verification failed")
        return real_verify(seq, logits, proposal)

    monkeypatch.setattr(engine_module, "verify", verify)
    e = engine(spec=NGRAM)
    got = run_staggered(e, ps, GREEDY)
    assert got[0].error == "IndexError: verification failed" and got[0].outputs[0].finish_reason == "abort"
    assert token_ids(got[1:]) == token_ids(expected)
    assert e.speculator.stats.accepted > 0
    assert e.block_manager.num_used_blocks == 0 and not e.requests
