"""Medusa heads: the contract between `kiln train-medusa` (writes them), `kiln build --medusa` (compiles
them into the engine graph) and the runtime (reads their logits).

Head i (1..K) guesses the token i steps after the one the LM head predicts, from the same last hidden
state. Two kinds:

- "medusa": with x the final norm's output at a row (what the LM head reads),

      medusa_logits[row, i-1] = lm_head(x + SiLU(W_i x + b_i))

  a residual block per head (Cai et al., "Medusa", 2024) feeding the model's own LM head, shared by all
  heads and the ordinary logits (docs/design.md, "Medusa heads", says why this form).
- "hydra": each head also reads the token before the one it guesses (Ankner et al., "Hydra", 2024): with
  s_0 = x and t_0 the token the row chose,

      s_i = s_{i-1} + C_i SiLU(A_i s_{i-1} + B_i embed(t_{i-1}) + b_i),   t_i = argmax over V' of lm_head[V'] s_i

  where V' (the draft vocabulary, the artifact's most frequent answer tokens) bounds the LM-head rows a
  guess reads and embed(t) is the input embedding (zero for a token outside V'). The chain runs after
  the step, on the token the sampler actually chose, so the engine graph only returns x at the rows the
  runtime asks for (medusa_hidden) and the chain is a small graph of its own (DRAFT_FILE, built by
  `kiln build --medusa`): inputs DRAFT_HIDDEN [B, D] and DRAFT_TOKEN [B], outputs DRAFT_TOKENS [B, K] and
  DRAFT_CONFIDENCE [B, K] (each head's probability of its guess, softmax over V'; graphs built before it
  existed lack it, and the runtime then proposes whole chains).

The artifact directory holds HEADS_FILE (``medusa.{i}.weight [D, D]`` in nn.Linear orientation,
``medusa.{i}.bias [D]``, i from 0; for hydra heads the hydra_names(i) tensors and DRAFT_VOCAB instead) and
INFO_FILE (a json: format, kind, num_heads, hidden_size, the model's fingerprint, the training data, time
and held-out accuracy). This module is torch-free: the runtime
reads MedusaSpec from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import require

HEADS_FILE = "medusa_heads.safetensors"
INFO_FILE = "medusa.json"
ARTIFACT_FORMATS = (1, 2)  # 2 adds the "kind" (absent in 1: "medusa") and hydra heads
ARTIFACT_FORMAT = 2
KINDS = ("medusa", "hydra")
DRAFT_FILE = "medusa_draft.onnx"  # in the engine directory of hydra heads
DRAFT_HIDDEN = "hidden"
DRAFT_TOKEN = "token"
DRAFT_TOKENS = "draft_tokens"
DRAFT_CONFIDENCE = "draft_confidence"
DRAFT_VOCAB = "hydra.vocab"  # int64 [V']: the draft vocabulary, most frequent first


def weight_name(head: int) -> str:
    return f"medusa.{head}.weight"


def bias_name(head: int) -> str:
    return f"medusa.{head}.bias"


def hydra_names(head: int) -> tuple[str, str, str, str]:
    """(A_i [D, D] on the state, B_i [D, D] on the token's embedding, b_i [D], C_i [D, D] out), nn.Linear
    orientation."""
    return (f"hydra.{head}.state_weight", f"hydra.{head}.token_weight", f"hydra.{head}.bias",
            f"hydra.{head}.out_weight")


@dataclass(frozen=True)
class MedusaSpec:
    """The heads compiled into an engine, as its manifest records them ("medusa"; absent: no heads)."""

    num_heads: int
    hidden_size: int
    top1_accuracy: tuple[float, ...] = ()  # per head, on the artifact's held-out split (what a proposer may trust)
    kind: str = "medusa"  # KINDS; "hydra": the graph returns medusa_hidden and DRAFT_FILE runs the chain

    def __post_init__(self) -> None:
        require(isinstance(self.num_heads, int) and self.num_heads > 0, "num_heads", "a positive integer",
                self.num_heads)
        require(isinstance(self.hidden_size, int) and self.hidden_size > 0, "hidden_size", "a positive integer",
                self.hidden_size)
        require(len(self.top1_accuracy) in (0, self.num_heads), "top1_accuracy", "one value per head or none",
                self.top1_accuracy)
        require(self.kind in KINDS, "kind", f"one of {KINDS}", self.kind)

    def to_dict(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "hidden_size": self.hidden_size,
                "top1_accuracy": list(self.top1_accuracy), "kind": self.kind}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MedusaSpec:
        return cls(num_heads=data["num_heads"], hidden_size=data["hidden_size"],
                   top1_accuracy=tuple(float(a) for a in data.get("top1_accuracy", ())),
                   kind=data.get("kind", "medusa"))
