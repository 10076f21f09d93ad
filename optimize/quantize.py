"""Quantization schemes of ``kiln build --quantization``: name -> (calibration needed, ONNX pass).

    none                   fp32 weights
    int8-weight-only       int8 per output channel, MatMulNBits bits=8          (quantize_int8.py)
    int4-rtn-g{32,64,128}  int4 round-to-nearest, group-wise, zero points       (quantize_int4.py)
    int4-awq-g{32,64,128}  AWQ scales folded in, then the int4 pass; needs an awq artifact
    int4-q4_1              llama.cpp's Q4_1 (groups of 32, exact minimum): lossless on Q4_1 GGUFs
                                                                                (quantize_q4_1.py)
    w8a8-smoothquant       SmoothQuant scales folded in, then W8A8 per-token    (quantize_w8a8.py);
                           needs a smoothquant artifact

Every scheme but none also stores the embedding table as 8-bit blocks (quantize_embedding.py).
The build calls ``prepare_checkpoint`` before export (the gpt-fast-style conversion step:
check the artifact's fingerprint, fold its scales into the weights) and ``quantize_model``
on the optimized graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx_ir as ir

from .quantize_embedding import quantize_embedding
from .quantize_int4 import GROUP_SIZES, quantize_int4
from .quantize_int8 import quantize_int8_weight_only
from .quantize_q4_1 import quantize_q4_1_pass
from .quantize_w8a8 import quantize_w8a8

Progress = Callable[[str], None]


class QuantizationError(ValueError):
    """A quantization option that cannot be built; the message says why."""


@dataclass(frozen=True)
class QuantScheme:
    name: str
    kind: str  # "none" | "int8" | "int4" | "q4_1" | "w8a8"
    group_size: int = 0
    calibration: str | None = None  # the calibration method whose artifact the scheme needs


def _schemes() -> dict[str, QuantScheme]:
    schemes = [QuantScheme("none", "none"), QuantScheme("int8-weight-only", "int8"),
               QuantScheme("w8a8-smoothquant", "w8a8", calibration="smoothquant"), QuantScheme("int4-q4_1", "q4_1", 32)]
    for g in GROUP_SIZES:
        schemes.append(QuantScheme(f"int4-rtn-g{g}", "int4", g))
        schemes.append(QuantScheme(f"int4-awq-g{g}", "int4", g, calibration="awq"))
    return {s.name: s for s in schemes}


SCHEMES = _schemes()


def parse_scheme(name: str) -> QuantScheme:
    if name not in SCHEMES:
        raise QuantizationError(f"unknown quantization {name!r}; choose one of {sorted(SCHEMES)}")
    return SCHEMES[name]


def check_options(quantization: str, calibration: str) -> QuantScheme:
    """Fail before any work when the scheme and the artifact (a path or "") do not go together."""
    scheme = parse_scheme(quantization)
    if scheme.calibration and not calibration:
        raise QuantizationError(
            f"quantization {scheme.name} needs the scales of `kiln calibrate MODEL --method {scheme.calibration} "
            f"-o DIR`; pass that DIR as --calibration"
        )
    if calibration and not scheme.calibration:
        raise QuantizationError(f"quantization {scheme.name} uses no calibration artifact; drop --calibration")
    return scheme


def prepare_checkpoint(checkpoint, quantization: str, calibration: str, progress: Progress | None = None):
    """The checkpoint to export: with the artifact's scales folded in when the scheme needs them."""
    scheme = check_options(quantization, calibration)
    if not scheme.calibration:
        return checkpoint
    from kiln.calibration.artifact import CalibrationArtifact, CalibrationError, apply_artifact

    try:
        artifact = CalibrationArtifact.load(calibration)
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc
    if artifact.method != scheme.calibration:
        raise QuantizationError(
            f"quantization {scheme.name} needs {scheme.calibration} scales, but {calibration} holds {artifact.method} scales"
        )
    group = artifact.hyperparameters.get("group_size")
    if scheme.kind == "int4" and group != scheme.group_size:
        raise QuantizationError(
            f"the AWQ artifact {calibration} was searched for int4 groups of {group}, not {scheme.group_size}; "
            f"build with int4-awq-g{group} or recalibrate with --group-size {scheme.group_size}"
        )
    try:
        folded = apply_artifact(checkpoint, artifact)
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc
    if progress:
        progress(f"folded {artifact.method} scales from {calibration}")
    return folded


def quantize_model(model: ir.Model, quantization: str, progress: Progress | None = None) -> int:
    """Run the scheme's pass on the optimized graph in place; returns how many MatMuls it converted."""
    scheme = parse_scheme(quantization)
    if scheme.kind == "none":
        return 0
    if scheme.kind == "int8":
        count = quantize_int8_weight_only(model)
    elif scheme.kind == "int4":
        count = quantize_int4(model, scheme.group_size)
    elif scheme.kind == "q4_1":
        count = quantize_q4_1_pass(model)
    else:
        count = quantize_w8a8(model)
    if progress:
        progress(f"  quantize_{scheme.kind}: converted {count} MatMuls")
    if count == 0:
        raise QuantizationError(f"quantization {scheme.name} found no linear layer to convert in the graph")
    embeddings = quantize_embedding(model)
    if progress:
        progress(f"  quantize_embedding: converted {embeddings} Gathers")
    return count
