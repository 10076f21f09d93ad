"""What the runtime returns: per-request outputs and engine statistics.

A stream (Engine.step, AsyncLLM.generate) carries deltas: each RequestOutput holds, per
sample, only the text, token ids and logprobs that are new since the previous output of
that request, so producing it costs the same at token 1 and token 10,000. The cumulative
view (what LLM.generate returns, what a non-streaming HTTP response shows) is built once by
merge_outputs from the deltas in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.runtime.kv_transfer import KvHandoff


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None  # 1 = most likely token
    decoded_token: str | None  # None until the caller's side decodes it (detokenizer.with_token_text)


@dataclass(frozen=True)
class CompletionOutput:
    """One sample: new text / token ids / logprobs (a delta) or all of them (a merged result)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the running total up to this output
    logprobs: list[dict[int, Logprob]] | None  # one {token id: Logprob} per token in token_ids
    finish_reason: str | None  # "stop" | "length" | "abort" | None (still running)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # LLM.chat with tools: the calls parsed out of `text`, OpenAI's {"id", "type", "function": {"name",
    # "arguments"}} (None: no tools asked for, or the model answered in text)
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_handoff: KvHandoff | None = None  # the prompt's KV, from an engine asked to export it (Engine.add)
    # why the engine failed this request alone (its samples end with finish_reason "abort"); None if it did not
    error: str | None = None


def merge_outputs(deltas: Iterable[RequestOutput]) -> RequestOutput:
    """The cumulative output of one request from its deltas, in the order they came."""
    deltas = list(deltas)
    if not deltas:
        raise ValueError("deltas is empty: merge needs at least one output of the request")
    by_index: dict[int, list[CompletionOutput]] = {}
    for delta in deltas:
        for out in delta.outputs:
            by_index.setdefault(out.index, []).append(out)
    last = deltas[-1]
    outputs = [merge_completions(parts) for _, parts in sorted(by_index.items())]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs, last.finished,
                         last.num_cached_tokens, error=last.error)


def merge_completions(parts: list[CompletionOutput]) -> CompletionOutput:
    """One sample's deltas, in order, as one."""
    last = parts[-1]
    logprobs = None if last.logprobs is None else [step for p in parts for step in p.logprobs or ()]
    return CompletionOutput(
        last.index, "".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
        last.cumulative_logprob, logprobs, last.finish_reason, last.stop_reason,
    )


@dataclass(frozen=True)
class StageTotals:
    """What a pipeline's stages did since its runner opened (kiln build --pipeline-stages): each stage's own
    seconds, the hidden-state bytes handed from stage to stage, the tokens they carried, each stage's resident
    memory its graph's load added (its weights and the session's own buffers), and how many stage processes died
    and were started again."""

    stage_seconds: tuple[float, ...] = ()
    bytes_moved: int = 0
    tokens: int = 0
    stage_resident_bytes: tuple[int, ...] = ()
    restarts: int = 0

    def __add__(self, other: StageTotals) -> StageTotals:
        """Two runners' totals (replicas summed for /metrics): stage seconds add stage by stage."""
        longer, shorter = sorted((self.stage_seconds, other.stage_seconds), key=len, reverse=True)
        seconds = tuple(a + (shorter[i] if i < len(shorter) else 0.0) for i, a in enumerate(longer))
        longer_rss, shorter_rss = sorted((self.stage_resident_bytes, other.stage_resident_bytes), key=len,
                                         reverse=True)
        resident = tuple(a + (shorter_rss[i] if i < len(shorter_rss) else 0) for i, a in enumerate(longer_rss))
        return StageTotals(seconds, self.bytes_moved + other.bytes_moved, self.tokens + other.tokens, resident,
                           self.restarts + other.restarts)


@dataclass(frozen=True)
class RankTotals:
    """What a tensor-parallel engine's ranks did since its runner opened (kiln build --tensor-parallel): each
    rank's own seconds (its bindings and run, all-reduce waits included), each rank's seconds waiting in
    kiln.AllReduce for the others, the bytes all ranks reduced, the steps, and how often the ranks were started
    again after one died."""

    rank_seconds: tuple[float, ...] = ()
    wait_seconds: tuple[float, ...] = ()
    all_reduce_bytes: int = 0
    steps: int = 0
    restarts: int = 0

    def __add__(self, other: RankTotals) -> RankTotals:
        """Two runners' totals (replicas summed for /metrics), rank by rank."""
        def add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
            longer, shorter = sorted((a, b), key=len, reverse=True)
            return tuple(x + (shorter[i] if i < len(shorter) else 0.0) for i, x in enumerate(longer))

        return RankTotals(add(self.rank_seconds, other.rank_seconds), add(self.wait_seconds, other.wait_seconds),
                          self.all_reduce_bytes + other.all_reduce_bytes, self.steps + other.steps,
                          self.restarts + other.restarts)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model (not served from the cache)
    num_spec_verifications: int = 0  # sequence-steps that checked speculative tokens
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    pipeline: StageTotals = StageTotals()  # empty for a one-graph engine
    tensor_parallel: RankTotals = RankTotals()  # empty for an engine without tensor-parallel ranks
    num_images_encoded: int = 0  # encoder runs per image (a vision-language engine's; its cache saves the rest)
    num_image_cache_hits: int = 0  # images whose embeddings came from the encoder's cache

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Kept proposals / proposals (None before any)."""
        return self.num_spec_accepted_tokens / self.num_spec_proposed_tokens if self.num_spec_proposed_tokens else None

    @property
    def spec_tokens_per_verification(self) -> float | None:
        """Tokens a sequence gained per step that checked proposals: the kept ones plus the target's own."""
        v = self.num_spec_verifications
        return 1 + self.num_spec_accepted_tokens / v if v else None
