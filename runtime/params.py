"""Frozen, validated configuration: per-request SamplingParams and per-engine RuntimeConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import InvalidParamError
from kiln.errors import require as _require
from kiln.runtime.structured.spec import StructuredOutput
from kiln.runtime.vision.local_media import allowed_media_dir

# Temperatures below this sample greedily: the distribution they ask for is the argmax's to within float rounding,
# and 1 / temperature overflows float32 from ~3e-39 (vLLM's _SAMPLING_EPS is the same 1e-5).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy, and so is any temperature below GREEDY_BELOW (as in
    vLLM: 1 / temperature would overflow the sampler's float arithmetic); top_k 0 and top_p 1 are off.

    Order of logit processing (as in vLLM): repetition/frequency/presence penalties on the
    raw logits, then the structured output's token mask, then temperature, then min_p, then top_k
    and top_p. Logprobs are those of the raw model distribution (log_softmax of the unprocessed logits).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the engine's max_seq_len
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0: only the sampled token's
    skip_special_tokens: bool = True
    # what the output must match (a JSON schema, a regex, ...): tokens outside it are masked before the cut-offs
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists / single strings from callers, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)  # NaN passes no range check with a useful message: name it first
            _require(isinstance(value, int | float) and math.isfinite(value), name, "a finite number", value)
        _require(isinstance(self.n, int) and self.n >= 1, "n", ">= 1", self.n)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", ">= 0 (0 = off)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _require(self.seed is None or isinstance(self.seed, int), "seed", "an int or None", self.seed)
        _require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", ">= 1 or None", self.max_tokens,
        )
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative", self.stop_token_ids)
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs", "None or in [0, 20]", self.logprobs,
        )
        _require(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
                 "a StructuredOutput (StructuredOutput.json_schema(...), .regex(...), ...) or None", self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


SPECULATIVE_METHODS = ("ngram", "draft", "medusa")


# hydra heads on SmolLM2, open chat, fp32, k = 3: 1.18x plain at 0.2 against 1.13x with whole chains, one
# measurement (docs/design.md, "Hydra heads"); the estimate from scored rows peaks at 0.15-0.3
HYDRA_MIN_GUESS_PROBABILITY = 0.2


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to num_tokens tokens per sequence, the target checks
    them in one step (runtime/speculative/).

    ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from ngram_max down to ngram_min). draft: a second engine dir (draft_engine) with
    the same tokenizer. medusa: heads compiled into the target engine. A step speculates only while its
    tokens, proposals included, stay within max_batch_tokens: past that, verifying costs more than it
    saves (docs/design.md, "Speculative decoding"). min_guess_probability (medusa): a chain of guesses is
    proposed only as far as the product of the heads' probabilities of their own guesses stays at or above
    it, so a step spends no verification rows on guesses the heads themselves doubt (0: whole chains; None:
    HYDRA_MIN_GUESS_PROBABILITY for hydra heads, where it measured faster, 0 for Medusa heads).
    """

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 3  # a 1-2 token match guesses wrong often enough to cost more than it gains (design.md)
    draft_engine: str | None = None
    max_batch_tokens: int = 8
    min_guess_probability: float | None = None

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "speculative method", f"one of {list(SPECULATIVE_METHODS)}",
                 self.method)
        _require(isinstance(self.num_tokens, int) and 1 <= self.num_tokens <= 32, "num_speculative_tokens",
                 "in [1, 32]", self.num_tokens)
        _require(isinstance(self.ngram_min, int) and self.ngram_min >= 1, "ngram_min", ">= 1", self.ngram_min)
        _require(isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "ngram_max",
                 f">= ngram_min ({self.ngram_min})", self.ngram_max)
        _require((self.draft_engine is not None) == (self.method == "draft"), "draft_engine",
                 "given exactly when the speculative method is 'draft'", self.draft_engine)
        _require(isinstance(self.max_batch_tokens, int) and self.max_batch_tokens >= 2, "max_batch_tokens", ">= 2",
                 self.max_batch_tokens)
        p = self.min_guess_probability
        _require(p is None or (isinstance(p, (int, float)) and 0 <= p < 1), "min_guess_probability", "in [0, 1)", p)
        _require(self.method == "medusa" or not p, "min_guess_probability",
                 "None or 0 unless the speculative method is 'medusa' (only Medusa heads score their guesses)", p)

    def guess_probability(self, hydra: bool) -> float:
        """min_guess_probability with its default resolved for the engine's kind of heads."""
        if self.min_guess_probability is not None:
            return float(self.min_guess_probability)
        return HYDRA_MIN_GUESS_PROBABILITY if hydra else 0.0


@dataclass(frozen=True)
class RuntimeConfig:
    """Engine-wide settings chosen at load time (the graph does not fix them)."""

    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None  # of available memory; default 0.1, capped
    max_num_seqs: int = 64
    max_num_tokens: int | None = None  # per-step token budget; default: the manifest's
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    max_model_len: int | None = None  # longest sequence served; default (and at most): the engine's max_seq_len
    chat_template: str | None = None  # a Jinja chat template replacing the engine's tokenizer_config.json one
    speculative: SpeculativeConfig | None = None
    # a staged engine's stages (kiln build --pipeline-stages N) in N Ray actors, num_threads each; 1: whatever
    # stages the engine has run in this process, one after another
    pipeline_parallel: int = 1
    # with pipeline_parallel > 1: the memory each stage actor may take beyond its Ray worker's own, a cap the
    # kernel enforces (pipeline/memory.py); a stage whose graph does not fit fails to load
    stage_memory_bytes: int | None = None
    # a staged engine's step as this many micro-batches of whole sequences, stage k computing one while stage k+1
    # computes the one before (pipeline/micro_batch.py); at most the step's sequences. None: one per stage where
    # the stages run in their own actors (pipeline_parallel > 1), the step whole where they take turns in this
    # process; 1: the step whole
    pipeline_micro_batches: int | None = None
    # a directory whose files image_url parts may name by file:// URL (kiln serve --allowed-media-path); None: none
    allowed_media_path: str | None = None
    # the ranks of an engine built with --tensor-parallel N, each in its own process pinned to its CPUs with
    # num_threads (default 1) ORT threads; None: the engine's rank count, and a number must equal it
    tensor_parallel: int | None = None

    def __post_init__(self) -> None:
        _require(self.tensor_parallel is None or self.tensor_parallel >= 1, "tensor_parallel", ">= 1",
                 self.tensor_parallel)
        _require(self.pipeline_parallel >= 1, "pipeline_parallel", ">= 1", self.pipeline_parallel)
        _require(self.stage_memory_bytes is None or (self.stage_memory_bytes > 0 and self.pipeline_parallel > 1),
                 "stage_memory_bytes", "> 0, and only with pipeline_parallel > 1 (stages in their own processes)",
                 self.stage_memory_bytes)
        _require(self.pipeline_micro_batches is None or self.pipeline_micro_batches >= 1, "pipeline_micro_batches",
                 ">= 1", self.pipeline_micro_batches)
        _require(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes", "> 0", self.kv_cache_bytes)
        _require(
            self.kv_cache_fraction is None or 0 < self.kv_cache_fraction <= 0.95,
            "kv_cache_fraction", "in (0, 0.95]", self.kv_cache_fraction,
        )
        _require(
            not (self.kv_cache_bytes is not None and self.kv_cache_fraction is not None),
            "kv_cache_bytes", "unset when kv_cache_fraction is set", self.kv_cache_bytes,
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(self.max_num_tokens is None or self.max_num_tokens >= 1, "max_num_tokens", ">= 1", self.max_num_tokens)
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1", self.num_threads)
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        _require(self.speculative is None or isinstance(self.speculative, SpeculativeConfig), "speculative",
                 "a SpeculativeConfig or None", self.speculative)
        self.media_dir()  # checks allowed_media_path

    def media_dir(self) -> Path | None:
        """allowed_media_path resolved (symlinks followed), or None; InvalidParamError when it is no directory."""
        if self.allowed_media_path is None:
            return None
        try:
            return allowed_media_dir(self.allowed_media_path)
        except ValueError as exc:
            raise InvalidParamError(str(exc), "allowed_media_path") from None
