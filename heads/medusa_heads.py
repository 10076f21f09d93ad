"""The Medusa heads as a torch module, and their artifact directory (kiln/medusa.py is the contract).

    heads = MedusaHeads(num_heads, hidden)       # zero-initialised: every head starts as the LM head
    logits = heads.logits(x, lm_head_weight)     # x: the final norm's output [N, D] -> [N, K, V]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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


class HydraHeads(nn.Module):
    """K heads chained on the token before the one each guesses (kiln/medusa.py, kind "hydra"):
    s_i = s_{i-1} + C_i SiLU(A_i s_{i-1} + B_i embed'(t_{i-1}) + b_i), guesses over the draft vocabulary."""

    def __init__(self, num_heads: int, vocab: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """vocab int64 [V']: the draft vocabulary; embed, lm_head [V, D]: the model's (frozen) tables."""
        super().__init__()
        hidden = embed.shape[1]
        # small B and C (from torch's seeded generator), zero A and b: each head starts near the identity on the
        # state, and both layers get gradients (with B or C zero, neither would)
        self.state_weight = nn.Parameter(torch.zeros(num_heads, hidden, hidden))
        self.token_weight = nn.Parameter(0.01 * torch.randn(num_heads, hidden, hidden))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))
        self.out_weight = nn.Parameter(0.01 * torch.randn(num_heads, hidden, hidden))
        index = torch.full((embed.shape[0],), len(vocab), dtype=torch.int64)
        index[vocab] = torch.arange(len(vocab))
        self.register_buffer("vocab", vocab.clone(), persistent=False)
        self.register_buffer("index", index, persistent=False)  # token -> its draft-vocabulary row (V': outside)
        rows = torch.cat([embed[vocab].detach().float(), torch.zeros(1, hidden)])
        self.register_buffer("embed_rows", rows, persistent=False)
        self.register_buffer("head_rows", lm_head[vocab].detach().float(), persistent=False)

    @property
    def num_heads(self) -> int:
        return int(self.state_weight.shape[0])

    def forward(self, x: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """x [N, D] (the final norm's output), before [N, K] (token ids: head i's token before) -> [N, K, D]."""
        rows = self.index[before]
        s, states = x, []
        for i in range(self.num_heads):
            s = self._step(s, rows[:, i], i)
            states.append(s)
        return torch.stack(states, 1)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., V'] over the draft vocabulary."""
        return states @ self.head_rows.T

    @torch.no_grad()
    def guess(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chain run free, as the draft graph runs it: [N, K] token ids after the row's chosen token."""
        rows, s, out = self.index[chosen], x, []
        for i in range(self.num_heads):
            s = self._step(s, rows, i)
            rows = self.logits(s).argmax(-1)
            out.append(self.vocab[rows])
        return torch.stack(out, 1)

    def _step(self, s: torch.Tensor, rows: torch.Tensor, i: int) -> torch.Tensor:
        inner = F.silu(s @ self.state_weight[i].T + self.embed_rows[rows] @ self.token_weight[i].T + self.bias[i])
        return s + inner @ self.out_weight[i].T

    def state(self) -> dict[str, torch.Tensor]:
        out = {medusa.DRAFT_VOCAB: self.vocab.clone()}
        for i in range(self.num_heads):
            tensors = (self.state_weight[i], self.token_weight[i], self.bias[i], self.out_weight[i])
            for name, tensor in zip(medusa.hydra_names(i), tensors, strict=True):
                out[name] = tensor.detach().clone().contiguous()
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

    @property
    def kind(self) -> str:
        return str(self.info.get("kind", "medusa"))

    def hydra_arrays(self) -> tuple[list[tuple[np.ndarray, ...]], np.ndarray]:
        """Hydra heads as numpy: ([(A_i, B_i, b_i, C_i) per head], the draft vocabulary int64 [V'])."""
        heads = [tuple(self.tensors[n].float().numpy() for n in medusa.hydra_names(i)) for i in range(self.num_heads)]
        return heads, self.tensors[medusa.DRAFT_VOCAB].numpy().astype(np.int64)  # type: ignore[return-value]

    def heads(self) -> MedusaHeads:
        if self.kind != "medusa":
            raise MedusaError(f"these are {self.kind} heads, not Medusa heads")
        heads = MedusaHeads(self.num_heads, self.hidden_size)
        with torch.no_grad():
            for i in range(self.num_heads):
                heads.weight[i] = self.tensors[medusa.weight_name(i)]
                heads.bias[i] = self.tensors[medusa.bias_name(i)]
        return heads.requires_grad_(False)

    def arrays(self):
        """(weights float32 [K, D, D] in nn.Linear orientation, biases float32 [K, D]) as numpy."""
        weights = np.stack([self.tensors[medusa.weight_name(i)].float().numpy() for i in range(self.num_heads)])
        biases = np.stack([self.tensors[medusa.bias_name(i)].float().numpy() for i in range(self.num_heads)])
        return weights, biases

    def spec(self) -> medusa.MedusaSpec:
        accuracy = self.info.get("heldout", {}).get("top1_accuracy", [])
        return medusa.MedusaSpec(self.num_heads, self.hidden_size, tuple(float(a) for a in accuracy), self.kind)

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
        if info.get("format") not in medusa.ARTIFACT_FORMATS:
            raise MedusaError(f"{info_path} has format {info.get('format')!r}; this kiln reads format "
                              f"{medusa.ARTIFACT_FORMAT} (retrain with `kiln train-medusa`)")
        artifact = cls(tensors, info)
        hidden = artifact.hidden_size
        if artifact.kind not in medusa.KINDS:
            raise MedusaError(f"{info_path} holds heads of kind {artifact.kind!r}; this kiln reads {medusa.KINDS}")
        if artifact.kind == "hydra":
            artifact._check_hydra(heads_path)
            return artifact
        for i in range(artifact.num_heads):
            w, b = tensors.get(medusa.weight_name(i)), tensors.get(medusa.bias_name(i))
            if w is None or b is None or tuple(w.shape) != (hidden, hidden) or tuple(b.shape) != (hidden,):
                raise MedusaError(f"{heads_path} lacks head {i}'s weight [{hidden}, {hidden}] and bias [{hidden}]")
        return artifact

    def _check_hydra(self, heads_path: Path) -> None:
        hidden = self.hidden_size
        vocab = self.tensors.get(medusa.DRAFT_VOCAB)
        if vocab is None or vocab.dim() != 1 or len(vocab) == 0 or vocab.dtype != torch.int64:
            raise MedusaError(f"{heads_path} lacks the hydra heads' draft vocabulary "
                              f"({medusa.DRAFT_VOCAB}, int64 [V'])")
        for i in range(self.num_heads):
            shapes = ((hidden, hidden), (hidden, hidden), (hidden,), (hidden, hidden))
            found = [self.tensors.get(n) for n in medusa.hydra_names(i)]
            if any(t is None or tuple(t.shape) != shape for t, shape in zip(found, shapes, strict=True)):
                raise MedusaError(f"{heads_path} lacks hydra head {i}'s weights [{hidden}, {hidden}] x3 and bias "
                                  f"[{hidden}]")

    def check_model(self, checkpoint) -> None:
        """The heads read this model's hidden states: same fingerprint (hence same hidden size)."""
        if self.info.get("model_fingerprint") != checkpoint.fingerprint():
            raise MedusaError(f"the Medusa heads were trained on {self.info.get('model_source')!r}, not on "
                              f"{checkpoint.source} (model fingerprints differ); train heads for this model with "
                              f"`kiln train-medusa`")
