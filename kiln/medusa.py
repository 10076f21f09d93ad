"""Medusa heads: the contract between `kiln train-medusa` (writes them), `kiln build --medusa` (compiles
them into the engine graph) and the runtime (reads their logits).

Head i (1..K) guesses the token i steps after the one the LM head predicts, from the same last hidden
state: with x the final norm's output at a row (what the LM head reads),

    medusa_logits[row, i-1] = lm_head(x + SiLU(W_i x + b_i))

a residual block per head (Cai et al., "Medusa", 2024) feeding the model's own LM head, shared by all
heads and the ordinary logits (docs/design.md, "Medusa heads", says why this form).

The artifact directory holds HEADS_FILE (``medusa.{i}.weight [D, D]`` in nn.Linear orientation,
``medusa.{i}.bias [D]``, i from 0) and INFO_FILE (a json: format, num_heads, hidden_size, the model's
fingerprint, the training data, time and held-out accuracy). This module is torch-free: the runtime
reads MedusaSpec from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import require

HEADS_FILE = "medusa_heads.safetensors"
INFO_FILE = "medusa.json"
ARTIFACT_FORMAT = 1


def weight_name(head: int) -> str:
    return f"medusa.{head}.weight"


def bias_name(head: int) -> str:
    return f"medusa.{head}.bias"


@dataclass(frozen=True)
class MedusaSpec:
    """The heads compiled into an engine, as its manifest records them ("medusa"; absent: no heads)."""

    num_heads: int
    hidden_size: int
    top1_accuracy: tuple[float, ...] = ()  # per head, on the artifact's held-out split (what a proposer may trust)

    def __post_init__(self) -> None:
        require(isinstance(self.num_heads, int) and self.num_heads > 0, "num_heads", "a positive integer",
                self.num_heads)
        require(isinstance(self.hidden_size, int) and self.hidden_size > 0, "hidden_size", "a positive integer",
                self.hidden_size)
        require(len(self.top1_accuracy) in (0, self.num_heads), "top1_accuracy", "one value per head or none",
                self.top1_accuracy)

    def to_dict(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "hidden_size": self.hidden_size,
                "top1_accuracy": list(self.top1_accuracy)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MedusaSpec:
        return cls(num_heads=data["num_heads"], hidden_size=data["hidden_size"],
                   top1_accuracy=tuple(float(a) for a in data.get("top1_accuracy", ())))
