"""``kiln eval ENGINE``: perplexity per domain on the corpus's evaluation split, greedy agreement with a
reference (fp32) engine, decode speed and engine size.

The engine runs through kiln.runtime's ONNX Runtime model runner (the same session, op library
and in-place KV pools as serving), one sequence at a time:
  * perplexity per domain (prose, technical, code, chat; kiln.corpus): non-overlapping windows of
    the split's text, each a fresh sequence from position 0, prefilled in chunks with logits on
    every row (or windows of one text file, reported as the domain "text");
  * greedy agreement: the reference engine continues each fixed prompt greedily; the engine
    under test is teacher-forced on that continuation and its argmax compared token by token;
  * decode tok/s: single-stream, one token per step after a short prompt (median step time);
  * chat answers: greedy answers to fixed chat questions through kiln.runtime.LLM (the serving
    path: chat template, scheduler, sampler), each flagged when it ends in a loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import InvalidParamError, require
from kiln.quant_scheme import RESCORED_HEAD_MAX_ROWS, LmHead

if TYPE_CHECKING:
    from kiln.corpus import DomainWindows

Progress = Callable[[str], None]


class EngineSession:
    """One engine dir, driven one sequence at a time (blocks 0.. reused by every sequence)."""

    def __init__(self, engine_dir: str | Path, max_tokens: int = 2048, threads: int | None = None):
        from tokenizers import Tokenizer

        from kiln.manifest import read_manifest
        from kiln.runtime.loader import open_engine_runner

        self.engine_dir = Path(engine_dir)
        self.manifest = read_manifest(self.engine_dir)
        self.max_tokens = max_tokens
        self.block_table = list(range(-(-max_tokens // self.manifest.build.block_size)))
        self.runner = open_engine_runner(self.engine_dir, self.manifest, len(self.block_table), threads)
        self.tokenizer = Tokenizer.from_file(str(self.engine_dir / "tokenizer.json"))
        # An int4-rescored head may rescore only steps of few rows (behind a MatMulNBits head, and int4-q4_1 engines
        # built before their head was rescored at every step), the ones decoding makes: score with those.
        rescored = self.manifest.build.lm_head is LmHead.INT4_RESCORED
        self.logits_chunk = RESCORED_HEAD_MAX_ROWS if rescored else 128

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def run(self, tokens: list[int], start: int, all_rows: bool) -> np.ndarray:
        """Feed tokens at positions start.. of the current sequence; logits of every row or the last."""
        from kiln.runtime.model_runner import Chunk, pack_chunks

        if start + len(tokens) > self.max_tokens:
            raise ValueError(f"sequence of {start + len(tokens)} tokens exceeds the evaluation KV pool "
                             f"({self.max_tokens})")
        return self.runner.execute(pack_chunks([Chunk(start, tokens, self.block_table)], all_rows))

    def prefill(self, tokens: list[int], chunk: int | None = None) -> np.ndarray:
        """All-row logits of a fresh sequence, prefilled chunk by chunk (of self.logits_chunk by default)."""
        chunk = chunk or self.logits_chunk
        return np.concatenate([self.run(tokens[i:i + chunk], i, True) for i in range(0, len(tokens), chunk)])

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        out = []
        logits = self.run(prompt, 0, False)
        for i in range(new_tokens):
            out.append(int(logits[-1].argmax()))
            if i + 1 < new_tokens:
                logits = self.run(out[-1:], len(prompt) + i, False)
        return out

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.engine_dir.rglob("*") if p.is_file())


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(-1))
    nll: np.ndarray = logsumexp - z[np.arange(len(targets)), targets]
    return nll


def perplexity(session: EngineSession, token_ids: list[int], window: int = 512, num_windows: int = 8,
               progress: Progress | None = None) -> tuple[float, int]:
    """(perplexity, number of predicted tokens) over the first num_windows windows."""
    n = min(num_windows, len(token_ids) // window)
    if n == 0:
        raise InvalidParamError(f"the text has {len(token_ids)} tokens, not one window of {window}; use a longer "
                                f"text or fewer window tokens", "window")
    return windows_perplexity(session, [token_ids[w * window:(w + 1) * window] for w in range(n)], progress)


def windows_perplexity(session: EngineSession, windows: list[list[int]], progress: Progress | None = None,
                       label: str = "perplexity", first: int = 0) -> tuple[float, int]:
    """(perplexity, number of predicted tokens) over windows, each a fresh sequence from position 0; the tokens
    predicted from the logits at positions first.. are scored (llama.cpp's llama-perplexity: first = window / 2)."""
    total, count = 0.0, 0
    for w, tokens in enumerate(windows):
        logits = session.prefill(tokens)
        nll = _nll(logits[first:-1], np.asarray(tokens[first + 1:]))
        total += float(nll.sum())
        count += len(nll)
        if progress:
            progress(f"{label} window {w + 1}/{len(windows)}: running ppl {np.exp(total / count):.3f}")
    return float(np.exp(total / count)), count


def prompt_set(text: str, session: EngineSession, count: int = 8, length: int = 32) -> list[list[int]]:
    """Fixed prompts: the first `length` tokens of every 25th paragraph of the evaluation text."""
    paragraphs = [p for p in text.split("\n\n") if len(p) > 200] or [text]
    return [session.encode(p)[:length] for p in paragraphs[::25][:count]]


def greedy_agreement(session: EngineSession, reference: EngineSession, prompts: list[list[int]],
                     new_tokens: int = 32) -> float:
    """Fraction of positions where session's argmax equals reference's greedy token (teacher-forced)."""
    agree, total = 0, 0
    for prompt in prompts:
        continuation = reference.greedy(prompt, new_tokens)
        logits = session.prefill(prompt + continuation[:-1])[len(prompt) - 1:]
        agree += int((logits.argmax(-1) == np.asarray(continuation)).sum())
        total += len(continuation)
    return agree / total


def decode_speed(session: EngineSession, prompt: list[int], new_tokens: int = 64) -> float:
    """Single-stream decode tokens/s: 1 / the median step time (robust to a busy machine)."""
    session.run(prompt, 0, False)
    token = prompt[-1]
    times = []
    for i in range(new_tokens):
        start = time.perf_counter()
        token = int(session.run([token], len(prompt) + i, False)[-1].argmax())
        times.append(time.perf_counter() - start)
    return float(1.0 / np.median(times))


CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Explain in two sentences what a noun is.",
    "Write a short sentence about the sea.",
)


def loops(tokens: list[int], repeats: int = 3) -> bool:
    """Degenerate repetition: the answer ends in some span said `repeats` times in a row
    ("la femme, la femme, la femme, ..."); a list whose items share a template does not."""
    n = len(tokens)
    return any(all(tokens[i] == tokens[i + p] for i in range(n - repeats * p, n - p))
               for p in range(1, n // repeats + 1))


def chat_answers(engine_dir: str | Path, max_tokens: int = 64, threads: int | None = None) -> list[dict[str, Any]]:
    """[{question, answer, degenerate, prompt_ids, answer_ids}] for CHAT_QUESTIONS, greedy, through
    the serving runtime."""
    from kiln.manifest import read_manifest
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.params import RuntimeConfig

    # a short question and 64 answer tokens: 512 positions per sequence is plenty, and a 64 MiB pool must hold
    # one whole sequence (the runtime refuses a pool that cannot; fp32 KV at SmolLM2's 2048 needs 90 MiB)
    max_model_len = min(512, read_manifest(Path(engine_dir)).max_seq_len)
    llm = LLM(engine_dir, RuntimeConfig(kv_cache_bytes=64 << 20, num_threads=threads, max_model_len=max_model_len))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS], params)
    return [{"question": q, "answer": o.outputs[0].text, "degenerate": loops(list(o.outputs[0].token_ids)),
             "prompt_ids": list(o.prompt_token_ids), "answer_ids": list(o.outputs[0].token_ids)}
            for q, o in zip(CHAT_QUESTIONS, outputs, strict=True)]


def divergence(reference: EngineSession, prompt: list[int], answer: list[int]) -> dict[str, Any]:
    """Where a (quantized) engine's greedy answer leaves the reference's greedy path, teacher-forced:
    the first answer token that is not the reference's argmax after the same prefix, the reference's
    log-probability margin there (its own token over the engine's; near 0 = a near-tie any rounding
    can flip), and whether the reference itself, put on the engine's path up to that token, loops.
    {"token_index": None} when the reference would have produced the same answer."""
    logits = reference.prefill(prompt + answer)[len(prompt) - 1:len(prompt) - 1 + len(answer)]
    greedy = logits.argmax(-1)
    differ = np.nonzero(greedy != np.asarray(answer))[0]
    if len(differ) == 0:
        return {"token_index": None}
    i = int(differ[0])
    logprobs = -_nll(logits[[i, i]], np.array([greedy[i], answer[i]]))  # of its token and ours
    forced = answer[:i + 1] + reference.greedy(prompt + answer[:i + 1], len(answer) - i - 1)
    return {"token_index": i, "reference_margin": float(logprobs[0] - logprobs[1]),
            "reference_loops_too": loops(forced)}


def trace_loops(reference: EngineSession, answers: list[dict[str, Any]]) -> int:
    """Add a "divergence" to each looping answer; return how many the reference loops on too
    (from the same first divergent token, or because it gives the very same answer)."""
    for a in answers:
        if a["degenerate"]:
            a["divergence"] = divergence(reference, a["prompt_ids"], a["answer_ids"])
    return sum(a["degenerate"] and (a["divergence"]["token_index"] is None or a["divergence"]["reference_loops_too"])
               for a in answers)


@dataclass(frozen=True)
class EvalReport:
    engine: str
    quantization: str
    kv_dtype: str
    text: str  # what the perplexity and the agreement prompts were measured on: a corpus split or a file
    scored: str  # which predicted tokens of each window count: "all", or "second half" (llama-perplexity's)
    perplexity: dict[str, float]  # per domain (prose, technical, code, chat), or {"text": ...} for --text
    eval_tokens: dict[str, int]  # predicted tokens per domain
    greedy_agreement: float | None  # vs the reference engine; None without one
    decode_tok_s: float
    engine_mb: float
    degenerate_answers: int  # of len(CHAT_QUESTIONS)
    # of those, answers the reference engine also loops on once put on the same first divergent token
    degenerate_in_reference_too: int | None
    chat: list[dict[str, Any]]
    corpus: dict[str, Any]  # the windows' manifest (corpus.manifest): sources, documents, token digests

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class EvalOptions:
    """What `kiln eval` measures on: the reference engine (for greedy agreement; None to skip it), the
    perplexity windows per domain, the onnxruntime threads (None: all cores), the text (None: the
    corpus's domains) and the corpus split (evaluation; validation when choosing a method)."""

    reference_dir: Path | None = None
    num_windows: int = 16  # per domain: 16 x 511 predicted tokens = 8k
    window: int = 512  # tokens per perplexity window
    threads: int | None = None
    text_file: Path | None = None
    split: str = "evaluation"
    # score only the second half of each window, every token predicted from at least window / 2 of context, as
    # llama.cpp's llama-perplexity does (its -c is the window): the figure to hold against that tool's
    score_second_half: bool = False

    @property
    def first_scored(self) -> int:
        """The first position whose logits are scored."""
        return self.window // 2 if self.score_second_half else 0

    def __post_init__(self) -> None:
        from kiln.corpus import SPLITS

        require(self.split in SPLITS, "split", f"one of {SPLITS}", self.split)
        require(self.num_windows >= 1, "num_windows", "at least 1", self.num_windows)
        require(self.window >= 2, "window", "at least 2 tokens (one to predict from, one predicted)", self.window)
        require(self.threads is None or self.threads >= 1, "threads", "None or >= 1", self.threads)


def _domain_windows(session: EngineSession,
                    options: EvalOptions) -> tuple[str, str, list[DomainWindows], dict[str, Any]]:
    """(what was measured, the prompts' text, [DomainWindows], manifest) for the options."""
    from kiln import corpus
    from kiln.chat_template import ChatTemplate
    from kiln.corpus.windows import domain_windows

    if options.text_file is not None:
        text = options.text_file.read_text(encoding="utf-8")
        ids = session.encode(text)
        if len(ids) < options.window:
            raise InvalidParamError(f"the text has {len(ids)} tokens, not one window of {options.window}; use a "
                                    f"longer text or fewer window tokens", "window")
        n = min(options.num_windows, len(ids) // options.window)
        windows = [ids[w * options.window:(w + 1) * options.window] for w in range(n)]
        per_domain = [corpus.DomainWindows("text", windows, [str(options.text_file)])]
        sources = [{"package": "user", "path": str(options.text_file), "licence": "supplied by the user"}]
        return str(options.text_file), text, per_domain, corpus.manifest("text", options.window, per_domain, sources)
    template = ChatTemplate(json.loads(p.read_text()) if (p := session.engine_dir / "tokenizer_config.json").is_file()
                            else {})
    domains = tuple(d for d in corpus.DOMAINS if d != "chat" or template.template is not None)
    per_domain = [domain_windows(d, options.split, session.encode, options.window, options.num_windows,
                                        template) for d in domains]
    prose = next(d for d in corpus.documents() if d.domain == "prose" and d.split == options.split)
    manifest = corpus.manifest(options.split, options.window, per_domain, corpus.source_records(domains))
    return f"corpus:{options.split}", prose.text, per_domain, manifest


def evaluate(engine_dir: str | Path, options: EvalOptions, progress: Progress | None = None) -> EvalReport:
    """The report on the corpus's domains (evaluation split), or on the text of options.text_file."""
    threads = options.threads
    session = EngineSession(engine_dir, max_tokens=max(options.window, 1024), threads=threads)
    source, text, per_domain, manifest = _domain_windows(session, options)
    ppl, counts = {}, {}
    for d in per_domain:
        ppl[d.domain], counts[d.domain] = windows_perplexity(session, d.windows, progress, f"{d.domain} perplexity",
                                                             options.first_scored)
    prompts = prompt_set(text, session)
    agreement = reference = None
    if options.reference_dir is not None:
        reference = EngineSession(options.reference_dir, max_tokens=1024, threads=threads)
        agreement = greedy_agreement(session, reference, prompts)
    speed = decode_speed(session, prompts[0])
    build, size_mb = session.manifest.build, session.size_bytes() / 2**20
    del session
    answers = chat_answers(engine_dir, threads=threads)
    in_reference = None if reference is None else trace_loops(reference, answers)
    for a in answers:
        del a["prompt_ids"], a["answer_ids"]
    scored = "second half" if options.score_second_half else "all"
    return EvalReport(str(engine_dir), build.quantization.name, build.kv_dtype, source, scored, ppl, counts, agreement,
                      speed, size_mb, sum(a["degenerate"] for a in answers), in_reference, answers, manifest)
