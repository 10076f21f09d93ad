"""The calibration artifact: ``scales.safetensors`` + ``calibration.json`` in one directory.

    scales.safetensors   "<group name>": smoothing scales s [K] (see smoothing.py), and
                         "kv.k_absmax" / "kv.v_absmax" [num_layers, num_kv_heads] (KV int8),
                         AWQ only: "clip.<linear>" [N, n_groups] weight clip ratios (awq.py)
                         and "norm_gain.<norm>" [hidden] tuned norm gains (norm_tuning.py),
                         "gptq.<linear>.codes|scale|zero" its GPTQ-rounded int4 weights (gptq.py)
    calibration.json     format, method, hyperparameters, the model's fingerprint and source,
                         the corpus split and token count, a per-group search report

Made offline by ``kiln calibrate``; ``apply_artifact`` is the small conversion step the build
runs before export: it checks the fingerprint and folds the scales into the weights (exact), then
clamps the AWQ-clipped linears and multiplies the tuned norm gains in (the two steps that change the
fp32 function, on purpose: both were fitted to the int4 rounding the build applies), and puts the
GPTQ-rounded weights in place of their linears' (already on the int4 grid: the build's rounding keeps them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError

from . import gptq
from .awq import CLIP_PREFIX, apply_clips
from .norm_tuning import GAIN_PREFIX, apply_gains
from .smoothing import fold, smooth_groups

FORMAT = "kiln-calibration"
VERSION = 1
SCALES_FILE = "scales.safetensors"
META_FILE = "calibration.json"
METHODS = ("smoothquant", "awq")


class CalibrationError(KilnError, RuntimeError):
    """Calibration that cannot run, or an artifact that cannot be used; the message says why in one sentence."""


@dataclass(frozen=True)
class CalibrationArtifact:
    method: str
    model_fingerprint: str
    hyperparameters: dict[str, Any]
    scales: dict[str, torch.Tensor] = field(repr=False)
    info: dict[str, Any] = field(default_factory=dict, repr=False)  # source, corpus, tokens, report

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() if v.dtype == torch.uint8 else v.contiguous().float()  # GPTQ codes stay uint8
                   for k, v in self.scales.items()}, str(path / SCALES_FILE))
        meta = {"format": FORMAT, "version": VERSION, "method": self.method,
                "model_fingerprint": self.model_fingerprint, "hyperparameters": self.hyperparameters, **self.info}
        (path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationArtifact:
        path = Path(path)
        if not (path / META_FILE).is_file() or not (path / SCALES_FILE).is_file():
            raise CalibrationError(f"{path} is not a calibration artifact (it needs {META_FILE} and {SCALES_FILE}); "
                                   f"make one with `kiln calibrate MODEL --method ... -o {path}`")
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CalibrationError(f"{path / META_FILE} is not a version-{VERSION} kiln calibration artifact")
        info = {k: v for k, v in meta.items()
                if k not in ("format", "version", "method", "model_fingerprint", "hyperparameters")}
        scales = load_file(str(path / SCALES_FILE))
        return cls(meta["method"], meta["model_fingerprint"], meta["hyperparameters"], scales, info)

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer, per-KV-head int8 scales (absmax / 127) for K and V: [num_layers, Hkv] each."""
        return self.scales["kv.k_absmax"] / 127.0, self.scales["kv.v_absmax"] / 127.0


def check_fingerprint(artifact: CalibrationArtifact, checkpoint) -> None:
    actual = checkpoint.fingerprint()
    if artifact.model_fingerprint != actual:
        raise CalibrationError(
            f"the calibration artifact was made for another model (fingerprint {artifact.model_fingerprint[:12]}, "
            f"from {artifact.info.get('model_source', '?')}) but {checkpoint.source} has fingerprint {actual[:12]}; "
            f"rerun `kiln calibrate` on this model"
        )


def apply_artifact(checkpoint, artifact: CalibrationArtifact):
    """A Checkpoint whose weights have the artifact's smoothing scales folded in (function unchanged)
    and, for AWQ, its per-group weight clips and tuned norm gains applied."""
    from kiln.export.checkpoint_types import Checkpoint

    check_fingerprint(artifact, checkpoint)
    groups = smooth_groups(checkpoint.spec, gqa_o=True)  # groups without scales in the artifact are skipped
    try:
        weights = fold(checkpoint.weights, groups, artifact.scales)
    except ValueError as exc:
        raise CalibrationError(f"the calibration artifact cannot be folded into this model: {exc}") from exc
    if any(k.startswith(CLIP_PREFIX) for k in artifact.scales):
        group_size = artifact.hyperparameters.get("group_size")
        if not group_size:
            raise CalibrationError(
                "the calibration artifact holds weight clips but no group size; rerun `kiln calibrate`"
            )
        try:
            weights = apply_clips(weights, artifact.scales, int(group_size))
        except (KeyError, RuntimeError) as exc:
            raise CalibrationError(f"the calibration artifact's weight clips do not fit this model ({exc}); "
                                   f"rerun `kiln calibrate`") from exc
    if any(k.startswith(GAIN_PREFIX) for k in artifact.scales):
        try:
            weights = apply_gains(weights, artifact.scales)
        except KeyError as exc:
            raise CalibrationError(f"the calibration artifact's norm gains do not fit this model (no {exc}); "
                                   f"rerun `kiln calibrate`") from None
    rounded = gptq.linears_in(artifact.scales)
    if rounded:
        weights = dict(weights)
        for linear in rounded:
            name = f"{linear}.weight"
            w = weights.get(name)
            try:
                q = gptq.unpack(artifact.scales, linear, w.shape[1]) if w is not None else None
            except (KeyError, RuntimeError):
                q = None
            if q is None or q.shape != w.shape:
                raise CalibrationError(f"the calibration artifact's GPTQ weights for {linear} do not fit this model; "
                                       f"rerun `kiln calibrate`")
            weights[name] = q
    return Checkpoint(spec=checkpoint.spec, weights=weights, tokenizer=checkpoint.tokenizer,
                      source=f"{checkpoint.source} + {artifact.method} scales")
