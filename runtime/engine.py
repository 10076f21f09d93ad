"""Engine: owns the scheduler, the model runner and the sampler; prepare, add, abort, step.

    step = schedule -> run -> postprocess

Everything but prepare (validation and tokenization, done on the caller's side) runs on one
thread: LLM's caller, or AsyncLLM's engine thread. A step's outputs are deltas.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kiln.errors import InvalidParamError
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Decoder, IncrementalDetokenizer, TextTokenizer
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.model_runner import ModelRunner, RunnerOutput, build_batch
from kiln.runtime.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.sampler import Sampler, SamplerOutput
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.ngram import NgramProposer
from kiln.runtime.speculative.proposer import Proposal, ProposalRequest, Proposer
from kiln.runtime.speculative.verify import SpecStats, verify
from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import CompiledGrammar, GrammarCompiler

log = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int
    max_num_tokens: int  # the step budget, resolved once by the loader (loader.step_token_budget)
    eos_token_ids: tuple[int, ...]
    threads: int = 1  # the engine's CPU threads (the sampler's too: the model's are idle while it samples)


@dataclass(frozen=True)
class EngineRequest:
    """A validated, tokenized request, made by Engine.prepare and taken by Engine.add.

    Preparing happens once per request, on the caller's side (AsyncLLM's event loop, LLM
    before anything runs), so a bad request fails there and the engine thread never re-tokenizes.
    """

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None = None  # params.structured compiled for the engine's tokenizer

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise InvalidParamError(f"params must be a SamplingParams, got {type(self.params).__name__}", "params")
        if not self.prompt_token_ids:
            raise InvalidParamError("prompt is empty: it must have at least one token", "prompt")


class _PendingOutput:
    """What one sequence has produced since its request's last output (handed out by take)."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0

    def take(self, seq: Sequence) -> CompletionOutput:
        want_lp = seq.params.logprobs is not None
        out = CompletionOutput(
            index=seq.index,
            text=self.detok.take(seq.is_finished),
            token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob if want_lp else None,
            logprobs=self.logprobs if want_lp else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        self.token_ids, self.logprobs = [], []
        return out


def prepare_request(request_id: str, prompt: str | list[int], params: SamplingParams, tokenizer: TextTokenizer,
                    vocab_size: int, max_seq_len: int) -> EngineRequest:
    """Tokenize and check a request against an engine's vocabulary and context; InvalidParamError naming the
    problem. Engine.prepare, and the cluster ingress (which holds no engine), both check requests here."""
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    else:
        text, ids = None, [int(t) for t in prompt]
    request = EngineRequest(request_id, text, ids, params)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidParamError(f"prompt token ids must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}", "prompt")
    limit = max_seq_len
    if params.max_tokens is None:
        if len(ids) >= limit:
            raise InvalidParamError(f"prompt has {len(ids)} tokens, which leaves no room under max_seq_len {limit}",
                                    "prompt")
    elif len(ids) + params.max_tokens > limit:
        # Name the field the caller can change: the prompt when it alone leaves no room, else max_tokens.
        param = "prompt" if len(ids) >= limit else "max_tokens"
        raise InvalidParamError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len ({limit})", param
        )
    return request


class Request:
    """One request's state: its n sequences (sample 0 computes the prompt; the others fork from it)."""

    def __init__(self, prepared: EngineRequest, tokenizer: Decoder, export_kv: bool = False) -> None:
        self.prepared = prepared
        self.export_kv = export_kv  # hand the prompt's KV out with the first token (a prefill engine)
        self.handoff: KvHandoff | None = None
        params, ids = prepared.params, prepared.prompt_token_ids
        arrival = time.monotonic()
        self.seqs = [Sequence(ids, params, index=i, arrival=arrival) for i in range(params.n)]
        for seq in self.seqs:
            seq.grammar = None if prepared.grammar is None else prepared.grammar.start()
        self.pending = [
            _PendingOutput(IncrementalDetokenizer(tokenizer, ids, params.skip_special_tokens, params.stop))
            for _ in range(params.n)
        ]
        self.forked = params.n == 1
        self.error: str | None = None  # set when the engine fails this request alone (Engine._fail)

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def take_output(self) -> RequestOutput:
        """The delta since the previous output: what each sample added."""
        p = self.prepared
        if self.error is not None:  # nothing more of a failed request: its state may be what failed
            outputs = [CompletionOutput(seq.index, "", [], None, None, seq.finish_reason) for seq in self.seqs]
            return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outputs, True,
                                 self.seqs[0].num_cached_tokens, error=self.error)
        outputs = [pending.take(seq) for seq, pending in zip(self.seqs, self.pending, strict=True)]
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outputs, self.finished,
                             self.seqs[0].num_cached_tokens, self.handoff)


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: TextTokenizer, config: RuntimeConfig, limits: EngineLimits,
        model_name: str = "kiln", proposer: Proposer | None = None,
    ) -> None:
        """proposer: the speculative proposer config.speculative asks for; the n-gram one is made here,
        others (they need files: a draft engine) come from the loader."""
        self.model_name = model_name
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.limits = limits
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, limits.max_num_tokens)
        self.sampler = Sampler(limits.threads)
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self.num_generated_tokens = 0
        self.peak_blocks_used = 0
        self.proposer = proposer or self._default_proposer()
        self.spec_stats = SpecStats()
        self._proposals: dict[Sequence, Proposal] = {}  # this step's, by sequence
        self._imports: deque[tuple[Request, KvHandoff]] = deque()  # handed-off requests waiting for blocks
        self._grammars: GrammarCompiler | None = None  # made on the first structured request

    def _default_proposer(self) -> Proposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_max, spec.ngram_min)
        raise InvalidParamError(f"speculative method {spec.method!r} needs its proposer from the loader "
                                "(load_engine)", "speculative")

    @property
    def max_seq_len(self) -> int:
        # A single sequence must always fit in the pool, or it could never finish.
        return min(self.limits.max_seq_len, self.runner.num_blocks * self.runner.block_size)

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        """Tokenize and check a request; ValueError naming the problem. Reads only what never
        changes after loading, so any thread may call it."""
        request = prepare_request(request_id, prompt, params, self.tokenizer, self.runner.vocab_size,
                                  self.max_seq_len)
        if params.structured is None:
            return request
        return dataclasses.replace(request, grammar=self._compile(params.structured))

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """spec compiled for this engine's tokenizer (tokenizer.json, read on the first structured request)."""
        if self._grammars is None:
            to_json = getattr(self.tokenizer, "to_json", None)
            if to_json is None:
                raise InvalidParamError(f"{spec.param}: this engine's tokenizer cannot drive structured output",
                                        spec.param)
            self._grammars = GrammarCompiler(to_json(), self.runner.vocab_size, self.limits.eos_token_ids)
        return self._grammars.compile(spec)

    def add(self, prepared: EngineRequest, kv: KvHandoff | None = None, export_kv: bool = False) -> None:
        """Queue a prepared request; its outputs come from step().

        kv: the prompt's KV and first token from another engine (a prefill replica): the request starts
        decoding on them, without computing its prompt. export_kv: the request's output that carries its
        first token also carries its prompt's KV (RequestOutput.kv_handoff) for another engine."""
        if prepared.request_id in self.requests:
            raise InvalidParamError(f"request_id {prepared.request_id!r} is already in use", "request_id")
        if kv is not None:
            kv.check(prepared.prompt_token_ids, self.runner.block_size, self.runner.kv_layout())
        if prepared.params.structured is not None and prepared.grammar is None:  # prepared without this engine
            prepared = dataclasses.replace(prepared, grammar=self._compile(prepared.params.structured))
        request = Request(prepared, self.tokenizer, export_kv)
        self.requests[prepared.request_id] = request
        for seq in request.seqs:
            self._by_seq[seq.seq_id] = request
        if kv is None:
            self.scheduler.add(request.seqs[0])
        else:
            self._imports.append((request, kv))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """prepare + add, for callers on the engine's own thread (CLI, bench, tests)."""
        self.add(self.prepare(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._imports = deque(item for item in self._imports if item[0] is not request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self._by_seq.pop(seq.seq_id, None)
            if self.proposer is not None:
                self.proposer.release(seq)
        return request.take_output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One model step; returns, for each request it advanced, what is new (a delta)."""
        changed = self._admit_imports()
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting requests")
            return self._take_outputs(changed)
        if self.proposer is not None:
            out = self._speculate(out)
        batch = build_batch(out)
        heads = self._medusa_rows(out)
        if heads is None:
            return self._postprocess(out, RunnerOutput(self.runner.execute(batch)), heads, changed)
        result = self.runner.execute_all(dataclasses.replace(batch, medusa_indices=batch.logits_indices[heads]))
        return self._postprocess(out, result, heads, changed)

    def _admit_imports(self) -> dict[str, Request]:
        """Start handed-off requests, in arrival order, while blocks allow: their KV is written into this
        engine's pools and their first token taken as sampled here (it is emitted with this step)."""
        changed: dict[str, Request] = {}
        while self._imports:
            request, kv = self._imports[0]
            seq = request.seqs[0]
            write = lambda ids, idx, kv=kv: self.runner.write_kv_blocks(ids, kv.blocks[:, idx])  # noqa: E731
            if not self.scheduler.admit_computed(seq, len(seq), write):
                break
            self._imports.popleft()
            seq.num_cached_tokens = kv.num_cached_tokens
            first = SamplerOutput(np.array([kv.first_token]), [kv.first_logprob], [kv.first_top_logprobs])
            self._append(seq, request, first, 0)
            self.num_generated_tokens -= 1  # the prefill engine generated (and counted) it
            changed[request.request_id] = request
        return changed

    def _medusa_rows(self, out: SchedulerOutput) -> np.ndarray | None:
        """The logits rows to compute the Medusa heads at (the proposer says how many of each sequence's
        verified rows: the accepted length is known only afterwards); None when the proposer reads no
        heads or the next step could not speculate anyway (as many decodes as _speculate switches off at)."""
        if self.proposer is None:
            return None
        widths = [len(out.proposals_of(r)) + 1 for r, need in enumerate(out.needs_logits) if need]
        wanted = [self.proposer.medusa_rows(w) for w in widths]
        spec = self.config.speculative
        assert spec is not None
        if not any(wanted) or (min(spec.max_batch_tokens, self.scheduler.max_num_tokens) - len(widths)) < len(widths):
            return None
        starts = np.cumsum([0, *widths[:-1]])
        return np.concatenate([np.arange(start, start + n) for start, n in zip(starts, wanted, strict=True)])

    def _speculate(self, out: SchedulerOutput) -> SchedulerOutput:
        """Proposals for the step's decodes, while the step stays within max_batch_tokens (past that,
        checking guesses costs more than it saves: docs/design.md), shared evenly among them."""
        spec = self.config.speculative
        assert spec is not None and self.proposer is not None
        # a structured row is not speculated: its proposals would need the grammar checked and rolled back
        decodes = [seq for (seq, n), need in zip(out.scheduled, out.needs_logits, strict=True)
                   if need and n == 1 and seq.num_output_tokens > 0 and seq.grammar is None]
        room = min(spec.max_batch_tokens, self.scheduler.max_num_tokens) - out.num_tokens
        share = min(spec.num_tokens, room // len(decodes)) if decodes else 0
        if share < 1:
            return out
        requests = []
        for seq in decodes:
            # k proposals emit up to k + 1 tokens: stay within max_tokens and max_seq_len
            left = self.max_seq_len - len(seq)
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            if left > 1:
                requests.append(ProposalRequest(seq, min(share, left - 1)))
        if not requests:
            return out
        proposed = {r.seq: p for r, p in zip(requests, self.proposer.propose(requests), strict=True) if p.token_ids}
        out = self.scheduler.add_proposals(out, {seq: p.token_ids for seq, p in proposed.items()})
        # what the budget and the free blocks let through
        self._proposals = {seq: proposed[seq].head(len(granted))
                           for (seq, _), granted in zip(out.scheduled, out.proposals, strict=True) if granted}
        return out

    def _postprocess(self, out: SchedulerOutput, result: RunnerOutput, heads: np.ndarray | None,
                     changed: dict[str, Request] | None = None) -> list[RequestOutput]:
        """Sample or verify each sequence's rows; hand the proposer the heads' logits (`heads`: the logits
        rows they were computed at) of the row that chose each sequence's latest token. changed: requests
        that already have output this step (handed-off ones that started)."""
        changed = {} if changed is None else changed
        logits = result.logits
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_manager.num_used_blocks)
        self.scheduler.update(out)
        seqs = out.to_sample
        if not seqs:
            return self._take_outputs(changed)
        if out.proposals:
            widths = [len(out.proposals_of(r)) + 1 for r, need in enumerate(out.needs_logits) if need]
            starts = np.cumsum([0, *widths[:-1]]).tolist()
        else:  # a row of logits each
            widths, starts = [1] * len(seqs), list(range(len(seqs)))
        plain = [i for i, w in enumerate(widths) if w == 1]
        next_rows = list(starts)  # per sequence, the row that chose its latest token
        if plain:
            rows = logits[: len(plain)] if len(plain) == len(widths) else logits[[starts[i] for i in plain]]
            for i, outcome in zip(plain, self._sample_rows(rows, [seqs[i] for i in plain]), strict=True):
                request = self._by_seq[seqs[i].seq_id]
                changed[request.request_id] = request
                if seqs[i].is_finished:  # a sibling sample failed its request
                    continue
                try:
                    if isinstance(outcome, Exception):
                        raise outcome
                    self._append(seqs[i], request, *outcome)
                except Exception as exc:  # noqa: BLE001 - fail this request alone, keep the step
                    self._fail(request, exc)
        for i, width in enumerate(widths):
            if width > 1:
                request = self._by_seq[seqs[i].seq_id]
                changed[request.request_id] = request
                if seqs[i].is_finished:
                    continue
                try:
                    next_rows[i] += self._accept(seqs[i], request, logits[starts[i]:starts[i] + width])
                except Exception as exc:  # noqa: BLE001 - fail this request alone, keep the step
                    self._fail(request, exc)
        extras = result.extras()
        if heads is not None and extras:
            assert self.proposer is not None
            where = {int(row): m for m, row in enumerate(heads)}  # logits row -> its row of the heads' outputs
            live = [i for i, seq in enumerate(seqs) if not seq.is_finished and next_rows[i] in where]
            self.proposer.observe([seqs[i] for i in live], [where[next_rows[i]] for i in live], extras)
        return self._take_outputs(changed)

    def _sample_rows(self, rows: np.ndarray, seqs: list[Sequence]) -> list[tuple[SamplerOutput, int] | Exception]:
        """Per row, its sample (an output and its row in it) or what sampling it raised. The rows are sampled
        together; only if that fails, one by one, so that one request's settings fail only that request."""
        try:
            sampled = self.sampler(rows, seqs)
            return [(sampled, row) for row in range(len(seqs))]
        except Exception:  # noqa: BLE001 - find the row that failed
            outcomes: list[tuple[SamplerOutput, int] | Exception] = []
            for row, seq in enumerate(seqs):
                try:
                    outcomes.append((self.sampler(rows[row:row + 1], [seq]), 0))
                except Exception as exc:  # noqa: BLE001
                    outcomes.append(exc)
            return outcomes

    def _fail(self, request: Request, exc: Exception) -> None:
        """End a request the step could not advance (its other samples too); its last output carries the
        error, and the step goes on for the others. Its blocks are freed as for an abort."""
        log.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc)
        request.error = f"{type(exc).__name__}: {exc}"
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def _take_outputs(self, changed: dict[str, Request]) -> list[RequestOutput]:
        results = []
        for request in changed.values():
            results.append(request.take_output())
            if request.finished:
                self.requests.pop(request.request_id, None)
                for seq in request.seqs:
                    self._by_seq.pop(seq.seq_id, None)
                    if self.proposer is not None:
                        self.proposer.release(seq)
        return results

    def _accept(self, seq: Sequence, request: Request, logits: np.ndarray) -> int:
        """Verify seq's proposals against its k + 1 rows of logits; append what is kept, one token at a
        time (stops apply to each), then roll its KV back to the kept tokens. Returns how many were kept."""
        proposal = self._proposals.pop(seq)
        verdict = verify(seq, logits, proposal)
        self.spec_stats.record(len(proposal.token_ids), verdict.num_accepted)
        tokens = np.array(verdict.token_ids, dtype=np.int64)
        lp = self.sampler.logprobs(logits[: len(tokens)], tokens, [seq] * len(tokens))
        sampled = SamplerOutput(tokens, *lp)
        for row in range(len(tokens)):
            self._append(seq, request, sampled, row)
            if seq.is_finished:
                return verdict.num_accepted  # its blocks are freed with it
        self.scheduler.settle(seq, verdict.num_accepted)
        return verdict.num_accepted

    def _append(self, seq: Sequence, request: Request, sampled: SamplerOutput, row: int) -> None:
        """Append a sampled token to seq and its pending output; fork the other samples after
        sample 0's first token; finish seq if it should stop."""
        token = int(sampled.token_ids[row])
        seq.append(token)
        self.num_generated_tokens += 1
        if request.export_kv and request.handoff is None:
            request.handoff = self._export(seq, sampled, row)
        pending = request.pending[seq.index]
        pending.token_ids.append(token)
        top, logprob = sampled.top_logprobs[row], sampled.sampled_logprobs[row]
        if top is not None and logprob is not None:  # both set exactly when the request asked for logprobs
            pending.cumulative_logprob += logprob
            pending.logprobs.append({t: Logprob(lp, rank, None) for t, (lp, rank) in top.items()})
        if not request.forked:
            request.forked = True
            for child in request.seqs[1:]:
                self.scheduler.add_forked(seq, child)
        self._check_stop(seq, pending.detok, token)

    def _export(self, seq: Sequence, sampled: SamplerOutput, row: int) -> KvHandoff:
        """The prompt's KV and the first token, read before a stop could free the blocks."""
        blocks = seq.block_table[: self.block_manager.blocks_needed(seq.num_prompt_tokens)]
        return KvHandoff(tuple(seq.token_ids[: seq.num_prompt_tokens]), int(sampled.token_ids[row]),
                         sampled.sampled_logprobs[row], sampled.top_logprobs[row], seq.num_cached_tokens,
                         self.runner.read_kv_blocks(blocks))

    def _check_stop(self, seq: Sequence, detok: IncrementalDetokenizer, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if not params.ignore_eos and token in self.limits.eos_token_ids:
            return self.scheduler.finish(seq, "stop", None)
        stop = detok.find_stop(len(detok.add(token)))
        if stop is not None:
            return self.scheduler.finish(seq, "stop", stop)
        if seq.grammar is not None:  # a complete match admits only EOS next: end it now, a step sooner
            seq.grammar.sync(seq.token_ids, seq.num_prompt_tokens)
            if seq.grammar.done:
                return self.scheduler.finish(seq, "stop", None)
        out_of_tokens = params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        if out_of_tokens or len(seq) >= self.max_seq_len:
            return self.scheduler.finish(seq, "length")
        return None

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens_computed=s.num_prompt_tokens_computed,
            num_spec_verifications=self.spec_stats.verifications,
            num_spec_proposed_tokens=self.spec_stats.proposed,
            num_spec_accepted_tokens=self.spec_stats.accepted,
        )
