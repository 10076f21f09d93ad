"""Chat-shaped self-distillation data for Medusa heads: the model's own greedy answers to chat prompts.

What the heads must guess at serving time is the model's next few tokens of a chat answer, so the rows
they train on are exactly that:

1. Prompts (``chat_prompts``): open questions made from templates ("What is a {word}?", "Write a short
   poem about {word}.", ...) over the headwords of The Devil's Dictionary (the corpus's calibration
   split), and the user turns of the corpus's calibration-split conversations (continue a passage of
   prose, technical text or code: chat_mix.py). Each is rendered with the model's chat template.
2. Answers (``engine_answers``): greedy, through the serving runtime on an fp32 engine of the same
   checkpoint (batched, paged: an order of magnitude faster on CPU than decoding in torch).
3. Rows (``teacher_forced_rows``): one torch forward of prompt + answer per sequence gives the final
   norm's output at every answer position at once; row j (predicting answer token j) is labelled with
   answer token j + i for head i, as greedy verification will score it.

Held out: CHAT_QUESTIONS (medusa_data.py), never templated here.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import torch

from .medusa_data import CHAT_QUESTIONS

Progress = Callable[[str], None]
IGNORE = -100

TEMPLATES = (
    "What is {a} {word}?",
    "Explain the word \"{word}\" in simple terms.",
    "Write a short poem about {word}.",
    "Give me three facts about {word}.",
    "How would you describe {word} to a child?",
    "Write two sentences using the word \"{word}\".",
    "What is the opposite of {word}? Explain briefly.",
    "Tell me a short story about {word}.",
    "Why does {word} matter in everyday life?",
    "List some synonyms for {word}.",
    "Write a short dialogue between two friends about {word}.",
    "What are the pros and cons of {word}?",
    "Write a haiku about {word}.",
    "Give me some tips about {word}.",
    "How can I explain {word} to my grandmother?",
    "What is the history of the word \"{word}\"?",
    "Describe {word} in one paragraph.",
    "Is {word} a good thing or a bad thing? Why?",
    "Write a short email to a friend about {word}.",
    "What are common misconceptions about {word}?",
    "Can you give an example of {word}?",
    "Write a limerick about {word}.",
    "How do people in different cultures think about {word}?",
    "What would the world be like without {word}?",
    "Suggest a title for a book about {word}.",
    "Write a short speech about {word}.",
    "What questions should I ask to understand {word} better?",
    "Compare {word} with something similar.",
    "Summarise what {word} means in one sentence.",
    "What is a fun fact about {word}?",
    "Write a short diary entry about {word}.",
    "How would a scientist describe {word}?",
)
_HEADWORD = re.compile(r"^([A-Z][A-Z\-]+), (?:n|v|adj|adv|pp|pron|prep|conj|interj|x)", re.M)
# one chat prompt in this many is a corpus request (its ~80-token passage costs ~2 answers' teacher forcing);
# 15, coprime with the held-out split's 8, so 1 request in 8 is held out like the questions
REQUEST_EVERY = 15


def headwords() -> list[str]:
    """The Devil's Dictionary's headwords, lower case, in dictionary order."""
    from kiln.corpus import devils_dictionary

    seen: dict[str, None] = {}
    for word in _HEADWORD.findall(devils_dictionary()):
        seen.setdefault(word.lower(), None)
    return list(seen)


def open_questions(count: int) -> list[str]:
    """count distinct questions: (headword, template) pairs in a fixed pseudo-random order, so the first
    count of a longer list are the same questions (answers cached for N prompts serve any N' <= N)."""
    words = headwords()
    pairs = list(range(len(words) * len(TEMPLATES)))
    if count > len(pairs):
        raise ValueError(f"{len(words)} headwords x {len(TEMPLATES)} templates make {len(pairs)} questions, "
                         f"fewer than {count}")
    random.Random(0).shuffle(pairs)
    out = []
    for pair in pairs[:count]:
        word, template = words[pair // len(TEMPLATES)], TEMPLATES[pair % len(TEMPLATES)]
        out.append(template.format(word=word, a="an" if word[0] in "aeiou" else "a"))
    assert_held_out(out)
    return out


def chat_prompts(count: int) -> list[str]:
    """count chat prompts: open questions, every REQUEST_EVERY-th a corpus request instead (prefix-stable)."""
    requests = count // REQUEST_EVERY
    questions, corpus = iter(open_questions(count - requests)), iter(corpus_requests(requests))
    out = [next(corpus) if n % REQUEST_EVERY == REQUEST_EVERY - 1 else next(questions) for n in range(count)]
    assert_held_out(out)
    return out


def self_instructed_prompts(engine_dir: str | Path, count: int, threads: int | None, say: Progress,
                            cache: Path | None = None, seed: int = 0) -> list[str]:
    """count chat prompts the model writes itself (Magpie, Xu et al. 2024): an instruct model continues the chat
    template's opening of a user turn with the kind of request it was trained to answer, so sampling that
    prefix draws from its own chat distribution — everyday questions the dictionary templates never ask.
    Kept: turns the model closed itself (a cut-off one is no question), each once, none near a held-out
    CHAT_QUESTION (same_question). Sampled with per-prompt seeds, so a run is reproducible; with cache (a
    .json file) the prompts are written once and reused while engine, count and seed match."""
    from kiln.runtime import LLM
    from kiln.runtime.params import RuntimeConfig

    header = {"engine": str(Path(engine_dir).resolve()), "count": count, "seed": seed}
    if cache is not None and cache.exists():
        found = json.loads(cache.read_text())
        if found.get("header") != header:
            raise ValueError(f"prompt cache {cache} holds prompts of {found.get('header')}, not {header}; "
                             "use another file")
        say(f"self-instructed prompts: {count} read from {cache}")
        return found["prompts"][:count]
    llm = LLM(engine_dir, RuntimeConfig(num_threads=threads, max_num_seqs=64))
    prompts = sample_user_turns(llm, count, say, seed)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"header": header, "prompts": prompts}))
    return prompts


def sample_user_turns(llm, count: int, say: Progress, seed: int = 0) -> list[str]:
    """count distinct user turns sampled from llm (runtime.LLM) after its chat template's user-turn opening,
    in chunks until enough are kept (self_instructed_prompts says which are)."""
    from kiln.runtime import SamplingParams

    opening, end = _user_turn_frame(llm.tokenizer)
    kept: dict[str, None] = {}
    drawn = 0
    while len(kept) < count:
        batch = min(256, max(64, count - len(kept)))  # chunks: progress, and no more drawn than needed
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=SELF_PROMPT_TOKENS, seed=seed * 1_000_003 + s,
                                 stop=(end,)) for s in range(drawn, drawn + batch)]
        for output in llm.generate([opening] * batch, params):
            text = output.outputs[0].text.strip()
            if output.outputs[0].finish_reason == "stop" and text and not same_question(text):
                kept.setdefault(text, None)
        drawn += batch
        say(f"self-instructed prompts: {min(len(kept), count)}/{count} kept of {drawn} sampled")
        if len(kept) < count and drawn >= SELF_PROMPT_DRAWS * count:
            raise ValueError(f"the model wrote only {len(kept)} usable user turns in {drawn} samples (closed within "
                             f"{SELF_PROMPT_TOKENS} tokens, distinct, no held-out question), fewer than the {count} "
                             "asked for: it may not be a chat model; use the template prompts (--prompt-source "
                             "templates)")
    return list(kept)[:count]


# a user turn longer than this is cut off, and dropped: the answers to long requests are grounded in them, not chat
SELF_PROMPT_TOKENS = 96
SELF_PROMPT_DRAWS = 4  # samples per prompt asked for before giving up (SmolLM2-Instruct: 1.2)
_MARK = "\x00kiln-user-turn\x00"


def _user_turn_frame(tokenizer) -> tuple[str, str]:
    """The chat template around a user's text: what comes before it (the system turn and the user header),
    and what closes it (what follows the text, up to its first line break)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}])
    before, after = text.split(_MARK, 1)
    end = after.split("\n")[0].strip()
    if not end:
        raise ValueError("the chat template closes a user turn with no marker; self-instructed prompts need one")
    return before, end


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def same_question(prompt: str) -> bool:
    """Whether prompt asks a held-out CHAT_QUESTION: equal to one, or holding one whole, up to case and
    punctuation ("What is photosynthesis and how does it work?" holds "What is photosynthesis?")."""
    words = f" {_words(prompt)} "
    return any(f" {_words(q)} " in words for q in CHAT_QUESTIONS)


def assert_held_out(prompts: list[str]) -> None:
    """The benchmark's open questions (CHAT_QUESTIONS) must never be trained on."""
    leaked = [p for p in prompts if same_question(p)]
    if leaked:
        raise AssertionError(f"held-out CHAT_QUESTIONS among the training prompts: {sorted(leaked)}")


def corpus_requests(count: int) -> list[str]:
    """The user turns of the first count calibration-split conversations (prose, technical, code in turn)."""
    from kiln.corpus.chat_mix import conversations

    return [c.messages[0]["content"] for c in islice(conversations("calibration"), count)]


def engine_answers(engine_dir: str | Path, questions: list[str], max_tokens: int, threads: int | None,
                   say: Progress, cache: Path | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per question, from the serving runtime on engine_dir (64 sequences in
    flight). With cache (a .jsonl file), answers found there are reused and new ones appended as each chunk
    finishes, so an interrupted run resumes and a longer prompt list pays only for its new prompts."""
    import time

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.params import RuntimeConfig

    header = {"engine": str(Path(engine_dir).resolve()), "max_tokens": max_tokens}
    done = _read_cache(cache, header) if cache is not None else {}
    todo = [q for q in dict.fromkeys(questions) if q not in done]
    say(f"answers: {len(questions) - len(todo)} of {len(questions)} prompts cached")
    if todo:
        llm = LLM(engine_dir, RuntimeConfig(num_threads=threads, max_num_seqs=64))
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        start, tokens = time.perf_counter(), 0
        for first in range(0, len(todo), 128):
            batch = todo[first:first + 128]
            outputs = llm.chat([[{"role": "user", "content": q}] for q in batch], params)
            new = {q: (list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for q, o in zip(batch, outputs,
                                                                                             strict=True)}
            done.update(new)
            if cache is not None:
                _append_cache(cache, header, new)
            tokens += sum(len(a) for _, a in new.values())
            say(f"answers: {first + len(batch)}/{len(todo)} new prompts, {tokens} tokens in "
                f"{time.perf_counter() - start:.0f}s")
    return [done[q] for q in questions]


def _read_cache(cache: Path, header: dict) -> dict[str, tuple[list[int], list[int]]]:
    if not cache.exists():
        return {}
    with cache.open() as f:
        found = json.loads(f.readline())
        if found != header:
            raise ValueError(f"answer cache {cache} holds answers of {found}, not {header}; use another file")
        return {r["q"]: (r["prompt"], r["answer"]) for r in map(json.loads, f)}


def _append_cache(cache: Path, header: dict, answers: dict[str, tuple[list[int], list[int]]]) -> None:
    fresh = not cache.exists()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("a") as f:
        if fresh:
            f.write(json.dumps(header) + "\n")
        for q, (prompt, answer) in answers.items():
            f.write(json.dumps({"q": q, "prompt": prompt, "answer": answer}) + "\n")


@torch.no_grad()
def teacher_forced_rows(model, sequences: list[tuple[list[int], list[int]]], num_heads: int,
                        say: Progress, batch_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D]: the final norm's output at each position that predicts an answer token (the prompt's last
    one and the answer's but its last); labels [n, K]: the answer token i places after the one predicted.
    Sequences of similar length run together, right-padded: under the causal mask a real position never sees
    the padding after it, so its state is the unpadded one; rows come back in the sequences' order."""
    from kiln.calibration.collect import run_layers

    kept = [n for n, (_, answer) in enumerate(sequences) if answer]
    order = sorted(kept, key=lambda n: len(sequences[n][0]) + len(sequences[n][1]))
    xs: dict[int, torch.Tensor] = {}
    first = 0
    while first < len(order):
        last = first + 1
        while last < len(order) and (last - first + 1) * (len(sequences[order[last]][0]) +
                                                           len(sequences[order[last]][1])) <= batch_tokens:
            last += 1
        group = order[first:last]
        longest = max(len(sequences[n][0]) + len(sequences[n][1]) - 1 for n in group)
        ids = torch.zeros((len(group), longest), dtype=torch.int64)
        for b, n in enumerate(group):
            prompt, answer = sequences[n]
            ids[b, :len(prompt) + len(answer) - 1] = torch.tensor(prompt + answer[:-1])
        hidden = model.model.norm(run_layers(model, ids, torch.arange(longest)[None].expand(len(group), -1)))
        for b, n in enumerate(group):
            prompt, answer = sequences[n]
            xs[n] = hidden[b, len(prompt) - 1:len(prompt) - 1 + len(answer)].clone()
        first = last
        say(f"hidden states of {first}/{len(order)} answers")
    return torch.cat([xs[n] for n in kept]), answer_labels(sequences, num_heads)


def answer_labels(sequences: list[tuple[list[int], list[int]]], num_heads: int) -> torch.Tensor:
    """labels [n, K] of teacher_forced_rows: row j of an answer is labelled with its tokens j + 1 .. j + K."""
    labels = [torch.full((0, num_heads), IGNORE, dtype=torch.int64)]
    for _, answer in sequences:
        target = torch.tensor(answer, dtype=torch.int64)
        rows = torch.full((len(target), num_heads), IGNORE, dtype=torch.int64)
        for i in range(1, num_heads + 1):
            rows[:max(len(target) - i, 0), i - 1] = target[i:]
        labels.append(rows)
    return torch.cat(labels)


def answer_tokens(sequences: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """[n]: the token each row of teacher_forced_rows chose (row j of an answer: its token j)."""
    return torch.tensor([t for _, answer in sequences for t in answer], dtype=torch.int64)


Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]


def cached_rows(model, splits: dict[str, list[tuple[list[int], list[int]]]], num_heads: int, say: Progress,
                cache: Path | None = None) -> Rows:
    """teacher_forced_rows of each split, read from or written to `cache` (a torch file {split: (x, labels)}):
    a 1,800-prompt run's 100k rows cost ~30 CPU-minutes to recompute. A cache is used only if it fits these
    answers and this model: each split's labels, recomputed from the answers, must be equal, and the shortest
    answer of each split, teacher-forced again, must give its cached rows."""
    if cache is None or not cache.exists():
        data = {name: teacher_forced_rows(model, seqs, num_heads, say) for name, seqs in splits.items()}
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(data, cache)
        return data
    data = torch.load(cache)
    if not isinstance(data, dict) or set(data) != set(splits):
        raise ValueError(f"rows cache {cache} holds the splits {sorted(data)}, not {sorted(splits)}; use another file")
    for name, seqs in splits.items():
        x, labels = data[name]
        if labels.shape[1] > num_heads:  # rows cached for more heads serve fewer: labels are tokens j + 1 .. j + K
            labels = labels[:, :num_heads]
            data[name] = (x, labels)
        if not torch.equal(labels, answer_labels(seqs, num_heads)):
            raise ValueError(f"rows cache {cache} was made from other answers or another head count than these "
                             f"(split {name!r}); use another file")
        shortest = min((n for n, (_, answer) in enumerate(seqs) if answer), key=lambda n: len(seqs[n][1]),
                       default=None)
        if shortest is None:
            continue
        first = sum(len(answer) for _, answer in seqs[:shortest])
        want, _ = teacher_forced_rows(model, [seqs[shortest]], num_heads, lambda _m: None)
        got = x[first:first + len(want)]
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
            raise ValueError(f"rows cache {cache} holds hidden states of another model than this one "
                             f"(split {name!r}); use another file")
    say(f"rows: {sum(x.shape[0] for x, _ in data.values())} read from {cache} (labels and a sample of states "
        "checked against the answers)")
    return data
