"""The token-mask provider: StructuredOutput specs compiled against an engine's tokenizer (llguidance), a
matcher per sequence, and the step's masks applied to its logits rows.

llguidance's tokenizer (the vocabulary's trie, ~1 s for SmolLM2's 49,152 tokens) is built once per engine, by the
loader while the model opens, so no request waits for it. Compiling a spec builds the grammar's lexer over the
vocabulary (1-3 ms for a 30-property schema); it happens once per distinct spec (an LRU cache) on the caller's
thread when a request is prepared, and each sequence starts from a copy of the compiled matcher (~10 us). A
matcher follows its sequence's output tokens by count (GrammarState.sync), so whatever appended them (a sample, a
fork's first token, a recompute after preemption, which keeps the tokens, the tokens kept by a speculative
verification) leaves it consistent without a hook at each place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

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
        # llguidance's tokenizer (the vocabulary's trie and slices): ~1 s for 49k tokens, built once
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def build_tokenizer(self, background: bool = False) -> None:
        """Start building llguidance's tokenizer (once): on a thread of its own when `background` (the loader
        overlaps it with opening the model), else here. Whoever needs it waits for the one build."""
        future: Future[llguidance.LLTokenizer] = Future()
        with self._lock:
            if self._tokenizer is not None:
                return
            self._tokenizer = future
        if background:
            threading.Thread(target=self._build, args=(future,), name="kiln-grammar-tokenizer", daemon=True).start()
        else:
            self._build(future)

    def _build(self, future: Future[llguidance.LLTokenizer]) -> None:
        try:
            tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                               eos_token=self._eos or None)
            # the tokenizer's first mask sets up tables lazily (~10-14 ms on 49k tokens): pay it here too
            llguidance.LLMatcher(tokenizer, StructuredOutput.json_object().llguidance_grammar(),
                                 log_level=0).compute_bitmask()
            future.set_result(tokenizer)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
            future.set_exception(exc)

    def wait_for_build(self) -> None:
        """Wait until a started build has ended, whatever its outcome."""
        if self._tokenizer is not None:
            wait([self._tokenizer])

    @property
    def tokenizer_ready(self) -> bool:
        """The tokenizer is built (using it does not wait)."""
        return self._tokenizer is not None and self._tokenizer.done()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer, built now if no build was started, else once that build ends."""
        self.build_tokenizer()
        assert self._tokenizer is not None
        return self._tokenizer.result()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's compiled grammar; InvalidParamError naming spec.param when it cannot be built for this
        tokenizer (too large, or a lexer limit)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            tokenizer = self.tokenizer
        except Exception as exc:  # noqa: BLE001 - llguidance could not read this vocabulary
            raise InvalidParamError(f"{spec.param}: this engine's tokenizer cannot drive structured output "
                                    f"({exc})", spec.param) from None
        matcher = llguidance.LLMatcher(tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidParamError(f"{spec.param}: the {spec.kind.replace('_', ' ')} cannot be compiled: "
                                    f"{matcher.get_error().strip().splitlines()[0]}", spec.param)
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


@dataclass
class _Prefetch:
    """Masks being filled while the model step runs, for these states at these positions."""

    states: list[GrammarState]
    consumed: list[int]
    vocab_size: int
    future: Future[Bitmask]

    def matches(self, states: Sequence[GrammarState], vocab_size: int) -> bool:
        return (vocab_size == self.vocab_size and len(states) == len(self.states)
                and all(a is b for a, b in zip(states, self.states, strict=True))
                and [s.consumed for s in states] == self.consumed)


class MaskStep:
    """Fills and applies one step's masks: the matchers of the constrained rows compute their bitmasks together
    on llguidance's threads (it releases the GIL), then the op library's kernel sets each row's disallowed
    logits to -inf. The engine starts the fill before the model step (prefetch), so it runs while the model
    does, and apply finds it done."""

    def __init__(self, threads: int = 1) -> None:
        self._executor = llguidance.LLExecutor(max(1, threads))
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar-mask")
        self._pending: _Prefetch | None = None
        self.overlap = True  # prefetch fills on the side; off: apply fills them itself (benchmarks compare)

    def prefetch(self, states: Sequence[GrammarState | None], vocab_size: int) -> None:
        """Start filling the masks of these states (synced, at the positions the next apply reads them) on a
        thread of their own; apply takes them when asked for the same states at the same positions."""
        self.settle()
        live = [s for s in states if s is not None]
        if self.overlap and live:
            self._pending = _Prefetch(live, [s.consumed for s in live], vocab_size,
                                      self._filler.submit(self.bitmask, live, vocab_size))

    def settle(self) -> None:
        """Wait for a fill in flight (its matchers are read on the other thread until it ends)."""
        if self._pending is not None:
            wait([self._pending.future])

    def apply(self, logits: npt.NDArray[np.float32], states: Sequence[GrammarState | None]) -> None:
        """In place on logits [rows, vocab] (C-contiguous float32): the rows whose state is not None masked."""
        self.settle()
        pending, self._pending = self._pending, None
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        live = [s for s in states if s is not None]
        if pending is not None and pending.matches(live, logits.shape[1]):
            bitmask = pending.future.result()  # raises what the fill raised, as filling it here would
        else:
            bitmask = self.bitmask(live, logits.shape[1])
        if len(rows) == logits.shape[0]:
            kernels.mask_rows(logits, bitmask)
            return
        subset = np.ascontiguousarray(logits[rows])
        kernels.mask_rows(subset, bitmask)
        logits[rows] = subset

    def apply_speculated(self, logits: npt.NDArray[np.float32], state: GrammarState, proposed: Sequence[int]) -> None:
        """In place on one sequence's verification rows [k + 1, vocab] (C-contiguous float32): row j masked with
        the grammar after the first j proposals, up to the first proposal the grammar refuses (verification
        rejects it there, so the rows after it are never read). The matcher is left where it was (llguidance
        advances it over the proposals and rolls it back)."""
        self.settle()
        valid = list(proposed[: state.matcher.validate_tokens(list(proposed))])
        if not valid:  # the first proposal is refused: only the first row is read
            kernels.mask_rows(logits[:1], self.bitmask([state], logits.shape[1]))
            return
        mask = np.zeros((len(valid) + 1, (logits.shape[1] + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask_par_with_draft_tokens(self._executor, [(state.matcher, 0, valid)], mask)
        if state.matcher.is_error():
            raise GrammarError(f"the grammar failed: {state.matcher.get_error()}")
        kernels.mask_rows(logits[: len(valid) + 1], mask)

    def bitmask(self, states: Sequence[GrammarState], vocab_size: int) -> Bitmask:
        """[len(states), ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t may come next."""
        mask = np.zeros((len(states), (vocab_size + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        for s in states:
            if s.matcher.is_error():
                raise GrammarError(f"the grammar failed: {s.matcher.get_error()}")
        return mask
