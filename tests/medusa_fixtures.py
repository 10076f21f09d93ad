"""Text for training Medusa heads on the tiny models: paragraphs of 200-800 characters, seeded."""

from __future__ import annotations

import random

_WORDS = ("the sea", "a letter", "she said", "was quite", "and then", "her sister", "in the morning", "went home",
          "with great", "pleasure", "at the house", "of course", "he", "they", "walked", "to town")


def tiny_text(paragraphs: int = 40, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        words: list[str] = []
        while len(" ".join(words)) < rng.randrange(220, 700):
            words.append(rng.choice(_WORDS))
        out.append(" ".join(words).capitalize() + ".")
    return "\n\n".join(out)
