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
)
_HEADWORD = re.compile(r"^([A-Z][A-Z\-]+), (?:n|v|adj|adv|pp|pron|prep|conj|interj|x)", re.M)


def headwords() -> list[str]:
    """The Devil's Dictionary's headwords, lower case, in dictionary order."""
    from .corpus import _devil

    seen: dict[str, None] = {}
    for word in _HEADWORD.findall(_devil()):
        seen.setdefault(word.lower(), None)
    return list(seen)


def open_questions(count: int) -> list[str]:
    """count questions: headwords spread over the dictionary, the templates taken in turn."""
    words = headwords()
    if count > len(words):
        raise ValueError(f"the dictionary has {len(words)} headwords, fewer than {count} questions")
    out = []
    for n in range(count):
        word = words[n * len(words) // count]
        a = "an" if word[0] in "aeiou" else "a"
        out.append(TEMPLATES[n % len(TEMPLATES)].format(word=word, a=a))
    held = set(CHAT_QUESTIONS)
    return [q for q in out if q not in held]


def corpus_requests(count: int) -> list[str]:
    """The user turns of the first count calibration-split conversations (prose, technical, code in turn)."""
    from .chat_mix import conversations

    return [c.messages[0]["content"] for c in islice(conversations("calibration"), count)]


def engine_answers(engine_dir: str | Path, questions: list[str], max_tokens: int, threads: int | None,
                   say: Progress) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per question, from the serving runtime on engine_dir."""
    import time

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.params import RuntimeConfig

    llm = LLM(engine_dir, RuntimeConfig(num_threads=threads, max_num_seqs=32))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out: list[tuple[list[int], list[int]]] = []
    start = time.perf_counter()
    for first in range(0, len(questions), 64):
        batch = questions[first:first + 64]
        for o in llm.chat([[{"role": "user", "content": q}] for q in batch], params):
            out.append((list(o.prompt_token_ids), list(o.outputs[0].token_ids)))
        elapsed = time.perf_counter() - start
        say(f"answers: {len(out)}/{len(questions)} prompts, {sum(len(a) for _, a in out)} tokens in "
            f"{elapsed:.0f}s")
    return out


@torch.no_grad()
def teacher_forced_rows(model, sequences: list[tuple[list[int], list[int]]], num_heads: int,
                        say: Progress) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D]: the final norm's output at each position that predicts an answer token (the prompt's last
    one and the answer's but its last); labels [n, K]: the answer token i places after the one predicted."""
    from .collect import run_layers

    xs, labels = [], []
    for n, (prompt, answer) in enumerate(sequences):
        if not answer:
            continue
        ids = torch.tensor([prompt + answer[:-1]])
        hidden = run_layers(model, ids, torch.arange(ids.shape[1])[None])[0, len(prompt) - 1:]
        xs.append(model.model.norm(hidden))
        target = torch.tensor(answer)
        rows = torch.full((len(answer), num_heads), IGNORE, dtype=torch.int64)
        for i in range(1, num_heads + 1):
            rows[:len(answer) - i, i - 1] = target[i:]
        labels.append(rows)
        if (n + 1) % 50 == 0:
            say(f"hidden states of {n + 1}/{len(sequences)} answers")
    return torch.cat(xs), torch.cat(labels)
