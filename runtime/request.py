"""A request inside the engine: EngineRequest (validated and tokenized, made on the caller's side) and
Request (its sequences and what each has produced since its last output)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kiln.errors import InvalidParamError
from kiln.runtime.detokenizer import Decoder, IncrementalDetokenizer, TextTokenizer
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.runtime.params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.structured.grammar import CompiledGrammar
from kiln.runtime.vision.prompt import ImageSpan


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
    images: tuple[ImageSpan, ...] = ()  # the prompt's images (their token runs are in prompt_token_ids)

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise InvalidParamError(f"params must be a SamplingParams, got {type(self.params).__name__}", "params")
        if not self.prompt_token_ids:
            raise InvalidParamError("prompt is empty: it must have at least one token", "prompt")


class PendingOutput:
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
        self.seqs = [Sequence(ids, params, index=i, arrival=arrival, images=prepared.images) for i in range(params.n)]
        for seq in self.seqs:
            seq.grammar = None if prepared.grammar is None else prepared.grammar.start()
        self.pending = [
            PendingOutput(IncrementalDetokenizer(tokenizer, ids, params.skip_special_tokens, params.stop))
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
