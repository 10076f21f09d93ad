"""The Medusa heads as a torch module, and their artifact directory (kiln/medusa.py is the contract).

    heads = MedusaHeads(num_heads, hidden)       # zero-initialised: every head starts as the LM head
    logits = heads.logits(x, lm_head_weight)     # x: the final norm's output [N, D] -> [N, K, V]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln import medusa
from kiln.errors import KilnError


class MedusaError(KilnError, ValueError):
    """A Medusa artifact that cannot be read or does not fit the model; the message says why."""


class MedusaHeads(nn.Module):
    """K residual blocks x + SiLU(W_i x + b_i), each feeding the shared LM head."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        # zero W and b: SiLU(0) = 0, so each head starts out predicting what the LM head does (Medusa's init)
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] (the final norm's output) -> the heads' hidden states [N, K, D]."""
        return x[:, None] + F.silu(torch.einsum("nd,kod->nko", x, self.weight) + self.bias)

    def logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[N, K, V] through the shared LM head weight lm_head [V, D]."""
        return F.linear(self(x), lm_head)

    def state(self) -> dict[str, torch.Tensor]:
        """The artifact's tensors, one W and b per head."""
        out = {}
        for i in range(self.num_heads):
            out[medusa.weight_name(i)] = self.weight[i].detach().clone().contiguous()
            out[medusa.bias_name(i)] = self.bias[i].detach().clone().contiguous()
        return out


@dataclass(frozen=True)
class MedusaArtifact:
    """What `kiln train-medusa` writes: the heads' tensors and a json of how they were made."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    info: dict[str, Any]  # num_heads, hidden_size, model_fingerprint, data, training, accuracy

    @property
    def num_heads(self) -> int:
        return int(self.info["num_heads"])

    @property
    def hidden_size(self) -> int:
        return int(self.info["hidden_size"])

    def heads(self) -> MedusaHeads:
        heads = MedusaHeads(self.num_heads, self.hidden_size)
        with torch.no_grad():
            for i in range(self.num_heads):
                heads.weight[i] = self.tensors[medusa.weight_name(i)]
                heads.bias[i] = self.tensors[medusa.bias_name(i)]
        return heads.requires_grad_(False)

    def arrays(self):
        """(weights float32 [K, D, D] in nn.Linear orientation, biases float32 [K, D]) as numpy."""
        import numpy as np

        weights = np.stack([self.tensors[medusa.weight_name(i)].float().numpy() for i in range(self.num_heads)])
        biases = np.stack([self.tensors[medusa.bias_name(i)].float().numpy() for i in range(self.num_heads)])
        return weights, biases

    def spec(self) -> medusa.MedusaSpec:
        accuracy = self.info.get("heldout", {}).get("top1_accuracy", [])
        return medusa.MedusaSpec(self.num_heads, self.hidden_size, tuple(float(a) for a in accuracy))

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / medusa.INFO_FILE).is_file():
            raise MedusaError(f"{out_dir} exists, is not empty and holds no Medusa heads; refusing to overwrite it")
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(out_dir / medusa.HEADS_FILE))
        (out_dir / medusa.INFO_FILE).write_text(json.dumps(self.info, indent=2, sort_keys=True))
        return out_dir

    @classmethod
    def load(cls, path: str | Path) -> MedusaArtifact:
        path = Path(path)
        info_path, heads_path = path / medusa.INFO_FILE, path / medusa.HEADS_FILE
        if not info_path.is_file() or not heads_path.is_file():
            raise MedusaError(f"{path} is not a Medusa heads directory (it needs {medusa.INFO_FILE} and "
                              f"{medusa.HEADS_FILE}; make one with `kiln train-medusa MODEL -o DIR`)")
        try:
            info = json.loads(info_path.read_text())
            from safetensors.torch import load_file

            tensors = load_file(str(heads_path))
        except Exception as exc:  # noqa: BLE001 - json and safetensors raise several types on damage
            raise MedusaError(f"{path} holds a damaged Medusa artifact ({type(exc).__name__}: {exc})") from exc
        if info.get("format") != medusa.ARTIFACT_FORMAT:
            raise MedusaError(f"{info_path} has format {info.get('format')!r}; this kiln reads format "
                              f"{medusa.ARTIFACT_FORMAT} (retrain with `kiln train-medusa`)")
        artifact = cls(tensors, info)
        hidden = artifact.hidden_size
        for i in range(artifact.num_heads):
            w, b = tensors.get(medusa.weight_name(i)), tensors.get(medusa.bias_name(i))
            if w is None or b is None or tuple(w.shape) != (hidden, hidden) or tuple(b.shape) != (hidden,):
                raise MedusaError(f"{heads_path} lacks head {i}'s weight [{hidden}, {hidden}] and bias [{hidden}]")
        return artifact

    def check_model(self, checkpoint) -> None:
        """The heads read this model's hidden states: same fingerprint (hence same hidden size)."""
        if self.info.get("model_fingerprint") != checkpoint.fingerprint():
            raise MedusaError(f"the Medusa heads were trained on {self.info.get('model_source')!r}, not on "
                              f"{checkpoint.source} (model fingerprints differ); train heads for this model with "
                              f"`kiln train-medusa`")
