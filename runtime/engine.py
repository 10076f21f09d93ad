"""Engine: owns the scheduler, the model runner and the sampler; add_request, abort, step.

    step = schedule -> run -> postprocess

Everything here runs on one thread (LLM's caller, or AsyncLLM's engine thread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kiln.errors import InvalidParamError
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Decoder, IncrementalDetokenizer
from kiln.runtime.model_runner import ModelRunner, build_batch
from kiln.runtime.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int
    max_num_tokens: int
    eos_token_ids: tuple[int, ...]


class Request:
    """One request: its n sequences (sample 0 computes the prompt; the others fork from it)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Decoder) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        arrival = time.monotonic()
        self.seqs = [Sequence(prompt_token_ids, params, index=i, arrival=arrival) for i in range(params.n)]
        self.detoks = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop)
            for _ in range(params.n)
        ]
        self.forked = params.n == 1

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        finished = self.finished
        want_lp = self.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=detok.visible_text(seq.is_finished),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=list(seq.logprobs) if want_lp else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq, detok in zip(self.seqs, self.detoks)
        ]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, finished, self.seqs[0].num_cached_tokens
        )


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer, config: RuntimeConfig, limits: EngineLimits, model_name: str = "kiln",
    ) -> None:
        self.model_name = model_name
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.limits = limits
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching)
        max_num_tokens = config.max_num_tokens or limits.max_num_tokens
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_num_tokens)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self.num_generated_tokens = 0
        self.peak_blocks_used = 0

    @property
    def max_seq_len(self) -> int:
        # A single sequence must always fit in the pool, or it could never finish.
        return min(self.limits.max_seq_len, self.runner.num_blocks * self.runner.block_size)

    # -- requests ---------------------------------------------------------------------------

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt; InvalidParamError (a ValueError naming the field) for bad input."""
        if not isinstance(params, SamplingParams):
            raise InvalidParamError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise InvalidParamError("prompt is empty: it must have at least one token", "prompt")
        vocab = self.runner.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidParamError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}", "prompt")
        limit = self.max_seq_len
        if params.max_tokens is None:
            if len(ids) >= limit:
                raise InvalidParamError(f"prompt has {len(ids)} tokens, which leaves no room under max_seq_len {limit}",
                                        "prompt")
        elif len(ids) + params.max_tokens > limit:
            raise InvalidParamError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len ({limit})", "prompt"
            )
        return text, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise InvalidParamError(f"request_id {request_id!r} is already in use", "request_id")
        text, ids = self.validate(prompt, params)
        request = Request(request_id, text, ids, params, self.tokenizer)
        self.requests[request_id] = request
        for seq in request.seqs:
            self._by_seq[seq.seq_id] = request
        self.scheduler.add(request.seqs[0])
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self._by_seq.pop(seq.seq_id, None)
        return request.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One model step; returns the outputs of the requests it advanced (cumulative)."""
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting requests")
            return []
        logits = self.runner.execute(build_batch(out.scheduled))
        return self._postprocess(out, logits)

    def _postprocess(self, out: SchedulerOutput, logits) -> list[RequestOutput]:
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_manager.num_used_blocks)
        seqs = self.scheduler.update(out)
        sampled = self.sampler(logits[: len(seqs)], seqs) if seqs else None
        changed: dict[str, Request] = {}
        for i, seq in enumerate(seqs):
            request = self._by_seq[seq.seq_id]
            token = int(sampled.token_ids[i])
            seq.append(token)
            self.num_generated_tokens += 1
            if sampled.top_logprobs[i] is not None:
                seq.cumulative_logprob += sampled.sampled_logprobs[i]
                seq.logprobs.append({
                    t: Logprob(lp, rank, self.tokenizer.decode([t], skip_special_tokens=False))
                    for t, (lp, rank) in sampled.top_logprobs[i].items()
                })
            if not request.forked:
                request.forked = True
                for child in request.seqs[1:]:
                    self.scheduler.add_forked(seq, child)
            self._check_stop(seq, request, token)
            changed[request.request_id] = request
        results = []
        for request in changed.values():
            results.append(request.output())
            if request.finished:
                self.requests.pop(request.request_id, None)
                for seq in request.seqs:
                    self._by_seq.pop(seq.seq_id, None)
        return results

    def _check_stop(self, seq: Sequence, request: Request, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if not params.ignore_eos and token in self.limits.eos_token_ids:
            return self.scheduler.finish(seq, "stop", None)
        detok = request.detoks[seq.index]
        stop = detok.find_stop(len(detok.add(token)))
        if stop is not None:
            return self.scheduler.finish(seq, "stop", stop)
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or len(seq) >= self.max_seq_len:
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
        )
