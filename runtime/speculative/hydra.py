"""The Medusa proposer for hydra heads: a chain of heads, each reading the token before the one it guesses.

The engine graph returns the final norm's output at the verified rows (`medusa_hidden`); after the step,
for the row that chose each sequence's latest token, the engine's draft graph (kiln/medusa.py, DRAFT_FILE)
runs the heads on that state and on the token the sampler actually chose, and the K guesses it returns
are the next step's proposal. Unlike plain Medusa heads, which guess from the state alone, the first head
knows the token it follows, which is where most of a small model's uncertainty about the next-but-one
token is (docs/design.md, "Hydra heads").

Guesses are kept with the sequence's length when they were made, as MedusaProposer keeps them: a
sequence whose latest token came from a row without a state (a plain step, a fork) gets no proposal
until a step returns its state again. Proposals are deterministic (one-hot): rejection sampling keeps
sampled output exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kiln import contract, medusa
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.medusa import KeptGuesses


class HydraProposer(KeptGuesses):
    def __init__(self, draft_graph: str | Path, num_threads: int | None = None, min_probability: float = 0.0) -> None:
        """draft_graph: the engine's DRAFT_FILE. One intra-op thread by default: a decode step's chain is a
        few matrix-vector products, cheaper than waking a pool for each. min_probability: SpeculativeConfig's
        min_guess_probability (a graph built before DRAFT_CONFIDENCE existed proposes whole chains)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads or 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(draft_graph), options, providers=["CPUExecutionProvider"])
        self.num_heads = int(self.session.get_outputs()[0].shape[-1])
        has_confidence = medusa.DRAFT_CONFIDENCE in {o.name for o in self.session.get_outputs()}
        super().__init__(min_probability if has_confidence else 0.0)
        self.outputs = [medusa.DRAFT_TOKENS] + ([medusa.DRAFT_CONFIDENCE] if self.min_probability else [])

    def medusa_rows(self, width: int) -> int:
        return width  # a state per verified row costs hidden_size floats, not an LM-head read

    def observe(self, seqs: list[Sequence], rows: list[int], extras: Mapping[str, np.ndarray]) -> None:
        if not seqs:
            return
        hidden = np.ascontiguousarray(extras[contract.MEDUSA_HIDDEN][rows], dtype=np.float32)
        tokens = np.array([seq.token_ids[-1] for seq in seqs], dtype=np.int64)
        guesses, *probabilities = self.session.run(self.outputs, {medusa.DRAFT_HIDDEN: hidden,
                                                                  medusa.DRAFT_TOKEN: tokens})
        self.keep_confident(seqs, guesses, probabilities[0] if probabilities else None)
