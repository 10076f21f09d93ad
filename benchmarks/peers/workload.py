"""The shapes every system runs, as token ids (so all of them see the very same tokens).

prefill: one prompt of 512 random tokens; single stream: one chat prompt (SmolLM2's template with its
default system message around a short question, ~37 tokens); batches: 16 and 32 different chat prompts;
each generation is exactly output_len tokens (EOS ignored). Serving: kiln bench's seeded random prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

QUESTIONS = [
    "What is the capital of France?", "How do plants make their food?", "Why is the sky blue?",
    "Who wrote Pride and Prejudice?", "What is a prime number?", "How far away is the Moon?",
    "What causes the seasons on Earth?", "How does a rainbow form?", "What is the speed of light?",
    "Why do cats purr?", "What is photosynthesis?", "How do vaccines work?", "What is an atom made of?",
    "Why does ice float on water?", "What is the tallest mountain?", "How do bees make honey?",
    "What is the largest ocean?", "How does a compass work?", "Why do leaves change colour?",
    "What is gravity?", "How do birds fly?", "What is the boiling point of water?", "Who painted the Mona Lisa?",
    "What is a black hole?", "How do volcanoes erupt?", "Why do we dream?", "What is the longest river?",
    "How does the heart pump blood?", "What is democracy?", "How are clouds formed?",
    "What is the Pythagorean theorem?", "Why is the ocean salty?",
]


@dataclass(frozen=True)
class Workload:
    prefill_prompt: list[int]
    single_prompt: list[int]
    batches: dict[int, list[list[int]]]  # batch size -> its prompts
    output_len: int

    def __post_init__(self) -> None:
        if self.output_len < 2:
            raise ValueError(f"output_len must be >= 2 (a decode rate needs two tokens), got {self.output_len}")

    def as_json(self) -> dict:
        return {"prefill_prompt": self.prefill_prompt, "single_prompt": self.single_prompt,
                "batches": list(self.batches.values()), "output_len": self.output_len}


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def make_workload(tokenizer, batch_sizes: list[int], output_len: int, prefill_len: int = 512) -> Workload:
    """tokenizer: kiln.runtime.tokenizer.Tokenizer (any folder with tokenizer.json + tokenizer_config.json)."""
    if max(batch_sizes) > len(QUESTIONS):
        raise ValueError(f"batch_sizes go up to {len(QUESTIONS)} (one question each), got {max(batch_sizes)}")
    rng = random.Random(512)
    prefill = [rng.randrange(100, tokenizer.vocab_size - 100) for _ in range(prefill_len)]
    return Workload(prefill, chat_ids(tokenizer, QUESTIONS[0]),
                    {b: [chat_ids(tokenizer, q) for q in QUESTIONS[:b]] for b in batch_sizes}, output_len)
