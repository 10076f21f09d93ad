"""Scheduler: token budget, decode-first chunked prefill, FCFS, preemption by recompute.

The randomized test drives the whole engine (scheduler + block manager + a fake model that
stores tokens in its paged pool) and calls BlockManager.check() after every step.
"""

import pytest
from fake_runner import CharTokenizer, make_fake_engine, make_windowed_fake_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import build_batch
from kiln.runtime.outputs import merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence

P = SamplingParams(temperature=0)


def make(num_blocks=32, block_size=4, max_num_tokens=8, max_num_seqs=8):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_num_seqs, max_num_tokens)


def add(s: Scheduler, n: int, arrival: float) -> Sequence:
    start = int(arrival * 100) + 1  # distinct prompts: no accidental prefix sharing
    seq = Sequence(list(range(start, start + n)), P, arrival=arrival)
    s.add(seq)
    return seq


def step(s: Scheduler, token: int = 7):
    """Schedule, 'run', and append a token to every sequence the output marks as sampling."""
    out = s.schedule()
    plan = [(seq, n) for seq, n in out.scheduled]
    sampling = out.to_sample
    s.update(out)
    assert sampling == [seq for seq, _ in plan if seq.num_computed_tokens == len(seq)]
    for seq in sampling:
        seq.append(token)
    s.bm.check()
    return plan, out


def test_budget_and_fcfs_chunking():
    _, s = make(max_num_tokens=8)
    a, b = add(s, 10, 0), add(s, 3, 1)
    plan, _ = step(s)
    assert plan == [(a, 8)]  # a takes the whole budget; b waits (FCFS, no skipping)
    plan, _ = step(s)
    assert plan == [(a, 2), (b, 3)]
    plan, _ = step(s)
    assert plan == [(a, 1), (b, 1)]
    assert a.block_table == [0, 1, 2] and b.block_table == [3]


def test_the_batch_asks_logits_for_the_rows_the_scheduler_marked():
    _, s = make(max_num_tokens=8)
    a, b = add(s, 10, 0), add(s, 3, 1)
    step(s)  # a: 8 of 10 computed
    out = s.schedule()
    assert out.scheduled == ((a, 2), (b, 3)) and out.needs_logits == (True, True)
    batch = build_batch(out)
    assert batch.logits_indices.tolist() == [1, 4] and batch.num_logits == 2
    chunk_only = SchedulerOutput(out.scheduled, (False, True))
    assert build_batch(chunk_only).logits_indices.tolist() == [4]
    assert chunk_only.to_sample == [b]
    with pytest.raises(ValueError, match="needs_logits has 1 entries for 2"):
        SchedulerOutput(out.scheduled, (True,))


def test_a_step_of_decodes_packs_as_any_step_does():
    """build_batch's decode-only path (plain lists) gives the arrays, dtypes and shapes of the general one,
    block tables of unequal length padded alike."""
    from kiln.runtime.model_runner import _pack_scheduled

    _, s = make(num_blocks=64, max_num_tokens=64)
    seqs = [add(s, n, i) for i, n in enumerate((3, 9, 4))]
    step(s)
    for _ in range(3):
        out = s.schedule()
        assert [n for _, n in out.scheduled] == [1, 1, 1] and all(out.needs_logits)
        fast, general = build_batch(out), _pack_scheduled(out)
        assert [len(seq.block_table) for seq in seqs] != [len(seqs[0].block_table)] * 3  # padding is exercised
        for name in ("input_ids", "position_ids", "query_start_loc", "seq_lens", "block_tables", "logits_indices"):
            a, b = getattr(fast, name), getattr(general, name)
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), name
        assert fast.num_logits == general.num_logits == 3
        s.update(out)
        for seq in seqs:
            seq.append(5)


def test_decodes_go_before_prefill_chunks():
    _, s = make(max_num_tokens=4)
    a = add(s, 2, 0)
    step(s)
    b = add(s, 20, 1)
    for _ in range(5):
        plan, _ = step(s)
        assert plan[0] == (a, 1)  # a long prompt never stalls a running decode
        assert plan[1] == (b, 3)
    c = add(s, 2, 2)  # arrives while b is still catching up: waits for the budget
    plan, _ = step(s)
    assert plan == [(a, 1), (b, 3)]
    assert c.status.value == "waiting"


def test_max_num_seqs_bounds_admission():
    _, s = make(max_num_tokens=64, max_num_seqs=2)
    a, b, c = add(s, 3, 0), add(s, 3, 1), add(s, 3, 2)
    plan, _ = step(s)
    assert [q for q, _ in plan] == [a, b]
    s.finish(a, "stop")
    plan, _ = step(s)
    assert plan == [(b, 1), (c, 3)]


def test_preempts_latest_arrival_and_resumes_from_cache():
    bm, s = make(num_blocks=4, block_size=4, max_num_tokens=16)
    a, b = add(s, 6, 0), add(s, 6, 1)
    step(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    step(s)
    step(s)  # both have 8 tokens computed: pool full
    plan, out = step(s)  # a needs a 3rd block: b (latest) is preempted
    assert out.preempted == (b,)
    assert plan == [(a, 1)]
    assert a.block_table == [0, 1, 3]  # b's tail block (3) was freed first and is reused first
    assert b.status.value == "waiting" and b.num_computed_tokens == 0 and b.block_table == []
    assert s.num_preemptions == 1
    s.finish(a, "stop")
    plan, _ = step(s)  # b resumes: its first block survived in the prefix cache
    assert plan == [(b, 5)]
    assert b.block_table[0] == 2 and s.prefix_cache_hits == 4
    bm.check()


def test_catching_up_sequence_shrinks_its_chunk_to_free_blocks():
    _, s = make(num_blocks=3, block_size=4, max_num_tokens=64)
    a = add(s, 3, 0)
    step(s)
    b = add(s, 20, 1)
    # b can only be admitted with its whole first chunk; 20 tokens need 5 blocks > 2 free
    plan, _ = step(s)
    assert plan == [(a, 1)]
    assert b.status.value == "waiting"


# -- randomized schedules on the full engine ------------------------------------------------

ops = st.lists(
    st.one_of(  # (op, x, max_tokens, shared prefix length, n, seeded sampling)
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 24), st.integers(1, 3),
                  st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0), st.just(0), st.just(1), st.just(False)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0), st.just(1), st.just(False)),
    ),
    min_size=4, max_size=40,
)
SHARED = [(7 * j) % 61 + 1 for j in range(40)]  # a common prefix, so requests hit the prefix cache


def _params(max_tokens: int, n: int, seeded: bool, request_index: int) -> SamplingParams:
    if seeded:  # a seeded sample's tokens do not depend on its batch, so the reference still applies
        return SamplingParams(n=n, temperature=1.0, seed=request_index, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine, schedule, abort=True):
    """Apply the schedule; returns each request's merged output (or "aborted")."""
    deltas, finals, ids = {}, {}, []

    def step():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                finals[out.request_id] = merge_outputs(deltas.pop(out.request_id))
        engine.block_manager.check()

    for op, x, y, shared, n, seeded in schedule:
        if op == "add":
            rid = f"r{len(ids)}"
            prompt = (SHARED[:shared] + [(len(ids) * 13 + 5 * j) % 63 + 1 for j in range(x)])[:40]
            engine.add_request(rid, prompt, _params(y, n, seeded, len(ids)))
            ids.append(rid)
        elif op == "abort" and abort and ids:
            out = engine.abort(ids[x % len(ids)])
            if out is not None:
                finals[out.request_id] = "aborted"
        else:
            for _ in range(x):
                step()
    while engine.has_unfinished():
        step()
    return finals


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=ops, num_blocks=st.integers(13, 20), max_num_tokens=st.integers(1, 24),
       caching=st.booleans())
def test_random_schedules_keep_invariants_and_outputs(schedule, num_blocks, max_num_tokens, caching):
    config = RuntimeConfig(max_num_seqs=6, enable_prefix_caching=caching)
    small = make_fake_engine(num_blocks, max_seq_len=52, max_num_tokens=max_num_tokens, config=config)
    finals = _run(small, schedule)
    bm = small.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owners
    reference = _run(make_fake_engine(256, max_seq_len=52, max_num_tokens=64), schedule, abort=False)
    adds = [op for op in schedule if op[0] == "add"]
    for rid, out in finals.items():
        if out == "aborted":
            continue
        _, _, max_tokens, _, n, _ = adds[int(rid[1:])]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference[rid].outputs], rid
        assert [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:  # the deltas add up: every token once, the text is theirs
            assert len(c.token_ids) == max_tokens and c.finish_reason == "length", rid
            assert c.text == CharTokenizer().decode(c.token_ids), rid


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=ops, window=st.integers(1, 14), spare_blocks=st.integers(0, 6), max_num_tokens=st.integers(1, 12),
       caching=st.booleans())
def test_random_schedules_with_a_sliding_window_release_blocks_and_keep_outputs(schedule, window, spare_blocks,
                                                                                max_num_tokens, caching):
    """A model that reads the last `window` positions: the engine releases the blocks behind every window, so a
    pool smaller than one 52-token sequence serves it, and every output equals an engine that releases nothing."""
    from kiln.runtime.block_manager import window_tokens

    num_blocks = window_tokens(window, max_num_tokens, 4) // 4 + spare_blocks
    config = RuntimeConfig(max_num_seqs=6, enable_prefix_caching=caching)
    small = make_windowed_fake_engine(num_blocks, window, max_seq_len=52, max_num_tokens=max_num_tokens,
                                      config=config)
    assert small.max_seq_len == 52  # one sequence fits: it holds its window and one chunk at most
    finals = _run(small, schedule)
    bm = small.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owners
    reference = _run(make_windowed_fake_engine(256, window, release=False, max_seq_len=52, max_num_tokens=64),
                     schedule, abort=False)
    for rid, out in finals.items():
        if out != "aborted":
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference[rid].outputs], rid


def test_a_sequence_longer_than_the_pool_runs_behind_its_window():
    engine = make_windowed_fake_engine(5, 8, max_seq_len=64, max_num_tokens=4)
    reference = make_windowed_fake_engine(64, 8, release=False, max_seq_len=64, max_num_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens: list[list[int]] = [[], []]
    for e, out_tokens in zip((engine, reference), tokens, strict=True):
        e.add_request("r", list(range(1, 21)), params)
        while e.has_unfinished():
            for out in e.step():
                out_tokens.extend(out.outputs[0].token_ids)
            e.block_manager.check()
    assert engine.peak_blocks_used <= 5 < reference.peak_blocks_used
    assert len(tokens[0]) == 40 and tokens[0] == tokens[1]
