"""Engine: owns the scheduler, the model runner and the sampler; prepare, add, abort, step.

    step = schedule -> run -> postprocess

Speculative decoding sits behind one Speculator (runtime/speculative/speculator.py), and the prompt KV
handed between prefill and decode replicas behind runtime/handoff.py. Everything but prepare (validation
and tokenization, done on the caller's side) runs on one thread: LLM's caller, or AsyncLLM's engine
thread. A step's outputs are deltas.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kiln.errors import InvalidParamError
from kiln.runtime.block_manager import BlockManager, window_tokens
from kiln.runtime.detokenizer import IncrementalDetokenizer, TextTokenizer
from kiln.runtime.handoff import HandoffQueue, export_handoff
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.model_runner import KvLostError, ModelRunner, RunnerOutput, build_batch
from kiln.runtime.outputs import EngineStats, Logprob, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams, SpeculativeConfig
from kiln.runtime.request import EngineRequest, Request, prepare_request
from kiln.runtime.sampler import Sampler, SamplerOutput
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.ngram import NgramProposer
from kiln.runtime.speculative.proposer import Proposer
from kiln.runtime.speculative.speculator import Speculator
from kiln.runtime.speculative.verify import SpecStats
from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from kiln.runtime.vision.prompt import ImageSpan, check_placeholders, expand_image_tokens, image_hash, runs_at

if TYPE_CHECKING:
    from PIL.Image import Image

    from kiln.runtime.vision.encoder import ImageEncoder

log = logging.getLogger("kiln.runtime")

__all__ = ["Engine", "EngineLimits", "EngineRequest", "prepare_request"]


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int
    max_num_tokens: int  # the step budget, resolved once by the loader (loader.step_token_budget)
    eos_token_ids: tuple[int, ...]
    threads: int = 1  # the engine's CPU threads (the sampler's too: the model's are idle while it samples)
    sliding_window: int = 0  # every layer's window: KV blocks behind it are released (block_manager.py); 0: none


def _default_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_max, spec.ngram_min)
    raise InvalidParamError(f"speculative method {spec.method!r} needs its proposer from the loader "
                            "(load_engine)", "speculative")


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
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching,
                                          limits.sliding_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, limits.max_num_tokens)
        self.sampler = Sampler(limits.threads)
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self.num_generated_tokens = 0
        self.peak_blocks_used = 0
        spec = config.speculative
        if spec is None and proposer is not None:
            raise InvalidParamError("a proposer needs config.speculative (its method and limits)", "speculative")
        self.speculator = None if spec is None else \
            Speculator(proposer or _default_proposer(spec), spec, self.scheduler, self.max_seq_len, self.sampler.masks)
        self.handoffs = HandoffQueue(self.scheduler, runner)  # handed-off requests waiting for blocks
        # structured output's compiler: the loader gives one whose llguidance tokenizer it built while the model
        # opened; else it is made on the first structured request
        self.grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # prepare runs on the server's worker threads
        self.image_encoder: ImageEncoder | None = None  # a vision-language engine's, set by the loader

    @property
    def proposer(self) -> Proposer | None:
        return None if self.speculator is None else self.speculator.proposer

    @property
    def max_seq_len(self) -> int:
        # A single sequence must always fit in the pool, or it could never finish; with a sliding window it holds
        # the window and one step's chunk at most, whatever its length.
        pool_tokens = self.runner.num_blocks * self.runner.block_size
        window = self.limits.sliding_window
        if window and pool_tokens >= window_tokens(window, self.limits.max_num_tokens, self.runner.block_size):
            return self.limits.max_seq_len
        return min(self.limits.max_seq_len, pool_tokens)

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                images: list[Image] | None = None) -> EngineRequest:
        """Tokenize and check a request; ValueError naming the problem. Reads only what never
        changes after loading, so any thread may call it. images: decoded images, one per image placeholder
        of the prompt, encoded here (a vision-language engine's, runtime/vision/)."""
        if images:
            ids, spans = self._expand_images(prompt, images)
            request = prepare_request(request_id, ids, params, self.tokenizer, self.runner.vocab_size,
                                      self.max_seq_len)
            request = dataclasses.replace(request, prompt=prompt if isinstance(prompt, str) else None, images=spans)
        else:
            request = prepare_request(request_id, prompt, params, self.tokenizer, self.runner.vocab_size,
                                      self.max_seq_len)
            if self.image_encoder is not None:
                check_placeholders(request.prompt_token_ids, self.image_encoder.spec.image_token_id, 0)
        if params.structured is None:
            return request
        return dataclasses.replace(request, grammar=self._compile(params.structured))

    @property
    def image_token(self) -> str | None:
        """The text of the image placeholder token (a vision-language engine's; None for a text engine)."""
        if self.image_encoder is None:
            return None
        return self.tokenizer.id_to_token(self.image_encoder.spec.image_token_id)

    @property
    def image_placeholder(self) -> str | None:
        """The text a chat message's image part becomes: the image token, in the family's layout (None for a
        text engine)."""
        token = self.image_token
        return None if token is None or self.image_encoder is None else self.image_encoder.spec.placeholder(token)

    def _expand_images(self, prompt: str | list[int], images: list[Image]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        encoder = self.image_encoder
        if encoder is None:
            raise InvalidParamError("this engine takes no images: it is not a vision-language engine", "images")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        check_placeholders(ids, encoder.spec.image_token_id, len(images))  # before any encoder run
        hashes = [image_hash(image) for image in images]
        try:
            layouts = encoder.layouts(images, self.tokenizer)
        except ValueError as exc:
            raise InvalidParamError(str(exc), "images") from exc
        if encoder.spec.family != "gemma3":
            return expand_image_tokens(ids, encoder.spec.image_token_id, encoder.encode(images, hashes), hashes,
                                       layouts)
        if encoder.spec.tokens_per_image > self.limits.max_num_tokens:  # a run is computed in one step
            raise InvalidParamError(f"an image takes {encoder.spec.tokens_per_image} tokens, more than the "
                                    f"engine's max_num_tokens {self.limits.max_num_tokens}", "images")
        embeddings = encoder.encode(images, hashes)
        if not isinstance(prompt, str):
            ids, spans = expand_image_tokens(ids, encoder.spec.image_token_id, embeddings, hashes, layouts)
            return ids, tuple(dataclasses.replace(span, bidirectional=True) for span in spans)
        layout = encoder.gemma3_prompt(self.tokenizer)  # text: expanded as its processor does, then tokenized
        ids = self.tokenizer.encode(layout.expand_text(prompt))
        return ids, runs_at(layout.run_starts(ids), embeddings, hashes, bidirectional=True)

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """spec compiled for this engine's tokenizer: by the loader's compiler, else by one made here on the first
        structured request (an Engine built without load_engine: its first request builds the tokenizer)."""
        with self._grammars_lock:  # one compiler even when the first requests come together
            if self.grammars is None:
                to_json = getattr(self.tokenizer, "to_json", None)
                if to_json is None:
                    raise InvalidParamError(f"{spec.param}: this engine's tokenizer cannot drive structured output",
                                            spec.param)
                self.grammars = GrammarCompiler(to_json(), self.runner.vocab_size, self.limits.eos_token_ids)
            grammars = self.grammars
        return grammars.compile(spec)

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
            self.handoffs.add(request.seqs[0], kv)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """prepare + add, for callers on the engine's own thread (CLI, bench, tests)."""
        self.add(self.prepare(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.handoffs.discard(request.seqs[0])
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self._by_seq.pop(seq.seq_id, None)
            if self.speculator is not None:
                self.speculator.release(seq)
        return request.take_output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One model step; returns, for each request it advanced, what is new (a delta)."""
        changed = self._start_handoffs()
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting requests")
            return self._take_outputs(changed)
        if self.speculator is not None:
            out = self.speculator.plan(out)
        self._prefetch_masks(out)
        try:
            result = self.runner.execute_all(build_batch(out))
        except KvLostError as exc:
            return self._lose_kv(exc, changed)
        return self._postprocess(out, result, changed)

    def _lose_kv(self, exc: KvLostError, changed: dict[str, Request]) -> list[RequestOutput]:
        """The runner's pools lost their contents (a pipeline stage restarted): fail every request holding
        blocks, as vLLM fails its requests when a worker dies, rather than recompute them, since a request that
        brought the stage down would bring it down again, forever; forget the prefix cache. Requests still
        waiting hold no K/V (preemption recomputes) and run once their turn comes."""
        for request in list(self.requests.values()):
            if any(seq.block_table for seq in request.seqs):
                self._fail(request, exc)
                changed[request.request_id] = request
        self.block_manager.forget_cached_blocks()
        return self._take_outputs(changed)

    def _prefetch_masks(self, out: SchedulerOutput) -> None:
        """Start the grammar masks of the step's plain (not speculated) rows, filled while the model runs: their
        tokens are all known before the step."""
        seqs = out.to_sample
        if not any(s.grammar is not None for s in seqs):
            return
        plain = [seqs[i] for i, count in enumerate(out.logits_rows.counts) if count == 1]
        try:
            for seq in plain:
                if seq.grammar is not None:
                    seq.grammar.sync(seq.token_ids, seq.num_prompt_tokens)
        except GrammarError:  # sampling meets it again and fails that request alone
            return
        self.sampler.masks.prefetch([s.grammar for s in plain], self.runner.vocab_size)

    def _start_handoffs(self) -> dict[str, Request]:
        """Start the handed-off requests blocks allow; their first token (sampled by the prefill engine,
        which counted it) is emitted with this step."""
        changed: dict[str, Request] = {}
        for seq, first in self.handoffs.admit():
            request = self._by_seq[seq.seq_id]
            self._append(seq, request, first, 0)
            self.num_generated_tokens -= 1
            changed[request.request_id] = request
        return changed

    def _postprocess(self, out: SchedulerOutput, result: RunnerOutput,
                     changed: dict[str, Request] | None = None) -> list[RequestOutput]:
        """Sample each sequence's one row, or verify its k + 1 rows (out.logits_rows); hand the speculator the
        heads' outputs at the row that chose each sequence's latest token. changed: requests that already have
        output this step (handed-off ones that started)."""
        changed = {} if changed is None else changed
        logits = result.logits
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_manager.num_used_blocks)
        self.scheduler.update(out)
        seqs = out.to_sample
        if not seqs:
            return self._take_outputs(changed)
        rows = out.logits_rows
        plain = [i for i, count in enumerate(rows.counts) if count == 1]
        latest_rows = list(rows.starts)  # per sequence, the row that chose its latest token
        if plain:
            sampled = logits[: len(plain)] if len(plain) == len(seqs) else logits[[rows.starts[i] for i in plain]]
            for i, outcome in zip(plain, self._sample_rows(sampled, [seqs[i] for i in plain]), strict=True):
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
        for i, (start, count) in enumerate(zip(rows.starts, rows.counts, strict=True)):
            if count > 1:
                request = self._by_seq[seqs[i].seq_id]
                changed[request.request_id] = request
                if seqs[i].is_finished:
                    continue
                try:
                    latest_rows[i] += self._accept(seqs[i], request, logits[start:start + count])
                except Exception as exc:  # noqa: BLE001 - fail this request alone, keep the step
                    self._fail(request, exc)
        if self.speculator is not None:
            self.speculator.observe(out, latest_rows, result.extras())
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
                    if self.speculator is not None:
                        self.speculator.release(seq)
        return results

    def _accept(self, seq: Sequence, request: Request, logits: np.ndarray) -> int:
        """Verify seq's proposals against its k + 1 rows of logits; append what is kept, one token at a
        time (stops apply to each), then roll its KV back to the kept tokens. Returns how many were kept."""
        assert self.speculator is not None
        verdict = self.speculator.verify(seq, logits)
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
            request.handoff = export_handoff(seq, sampled, row, self.block_manager, self.runner)
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
        spec = self.speculator.stats if self.speculator is not None else SpecStats()
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
            num_spec_verifications=spec.verifications,
            num_spec_proposed_tokens=spec.proposed,
            num_spec_accepted_tokens=spec.accepted,
            pipeline=self.runner.stage_totals(),
            tensor_parallel=self.runner.rank_totals(),
            num_images_encoded=0 if self.image_encoder is None else self.image_encoder.images_encoded,
            num_image_cache_hits=0 if self.image_encoder is None else self.image_encoder.cache_hits,
        )
