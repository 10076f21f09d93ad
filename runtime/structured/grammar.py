"""The token-mask provider: StructuredOutput specs compiled against an engine's tokenizer (llguidance), a
matcher per sequence, and the step's masks applied to its logits rows.

Compiling builds the grammar's lexer over the vocabulary (~10 ms for a 30-property schema on SmolLM2's 49,152
tokens); it happens once per distinct spec (an LRU cache) on the caller's thread when a request is prepared, and
each sequence starts from a copy of the compiled matcher (~10 us). A matcher follows its sequence's output tokens
by count (GrammarState.sync), so whatever appended them (a sample, a fork's first token, a recompute after
preemption, which keeps the tokens) leaves it consistent without a hook at each place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.numpy import fill_next_token_bitmask_par

from kiln.errors import InvalidParamError
from kiln.runtime.ops import sampling as kernels
from kiln.runtime.structured.spec import StructuredOutput

Bitmask = npt.NDArray[np.int32]


class GrammarError(RuntimeError):
    """A sequence's tokens left its grammar (a bug: the mask allowed only what the grammar accepts)."""


class GrammarState:
    """One sequence's position in its grammar: the llguidance matcher after its first `consumed` output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def sync(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Advance the matcher over the sequence's output tokens (token_ids[num_prompt_tokens:]) it has not seen,
        or roll it back over those no longer there."""
        num_output = len(token_ids) - num_prompt_tokens
        if num_output < self.consumed:
            if not self.matcher.rollback(self.consumed - num_output):
                raise GrammarError(f"cannot roll the grammar back: {self.matcher.get_error()}")
            self.consumed = num_output
        if num_output == self.consumed or self.matcher.is_stopped():
            self.consumed = num_output  # tokens past the grammar's end (ignore_eos) are not its
            return
        new = list(token_ids[num_prompt_tokens + self.consumed:])
        if not self.matcher.consume_tokens(new):
            raise GrammarError(f"output token(s) {new} left the grammar: {self.matcher.get_error()}")
        self.consumed = num_output

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no more text (only end of sequence)."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """What the sequence wrote so far is a whole match (it could end here)."""
        return bool(self.matcher.is_accepting())


class CompiledGrammar:
    """A spec compiled for one tokenizer; start() gives a fresh state for each sequence."""

    def __init__(self, spec: StructuredOutput, matcher: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._matcher = matcher

    def start(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy())


class GrammarCompiler:
    """Compiles specs against one engine's tokenizer, caching the last `cache_size` distinct ones. Thread-safe:
    requests are prepared on the server's event loop while the engine thread reads nothing of this."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 64) -> None:
        """tokenizer_json: the engine's tokenizer.json text; vocab_size: the logits' width (may exceed the
        tokenizer's: the padding tokens are never allowed)."""
        self._tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~1 s for 49k tokens
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's compiled grammar; InvalidParamError naming spec.param when it cannot be built for this
        tokenizer (too large, or a lexer limit)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        matcher = llguidance.LLMatcher(self.tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidParamError(f"{spec.param}: the {spec.kind.replace('_', ' ')} cannot be compiled: "
                                    f"{matcher.get_error().strip().splitlines()[0]}", spec.param)
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


class MaskStep:
    """Fills and applies one step's masks: the matchers of the constrained rows compute their bitmasks together
    on llguidance's threads (it releases the GIL), then the op library's kernel sets each row's disallowed
    logits to -inf."""

    def __init__(self, threads: int = 1) -> None:
        self._executor = llguidance.LLExecutor(max(1, threads))

    def apply(self, logits: npt.NDArray[np.float32], states: Sequence[GrammarState | None]) -> None:
        """In place on logits [rows, vocab] (C-contiguous float32): the rows whose state is not None masked."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        bitmask = self.bitmask([s for s in states if s is not None], logits.shape[1])
        if len(rows) == logits.shape[0]:
            kernels.mask_rows(logits, bitmask)
            return
        subset = np.ascontiguousarray(logits[rows])
        kernels.mask_rows(subset, bitmask)
        logits[rows] = subset

    def bitmask(self, states: Sequence[GrammarState], vocab_size: int) -> Bitmask:
        """[len(states), ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t may come next."""
        mask = np.zeros((len(states), (vocab_size + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        for s in states:
            if s.matcher.is_error():
                raise GrammarError(f"the grammar failed: {s.matcher.get_error()}")
        return mask
