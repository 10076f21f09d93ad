"""The quantization schemes' build steps (kiln/quant_scheme.py names them):

    none                   fp32 weights
    int8-weight-only       quantize_int8.py
    int4-rtn-g{32,64,128}  quantize_int4.py
    int4-awq-g{32,64,128}  AWQ scales folded in (prepare_checkpoint), then quantize_int4.py
    int4-q4_1              quantize_q4_1.py
    gguf, gguf-exact       quantize_gguf.py (a GGUF's blocks kept; the head too, as every linear; int8 or float32
                           activations)
    w8a8-smoothquant       SmoothQuant scales folded in (prepare_checkpoint), then quantize_w8a8.py

The int4 schemes give the tied LM head int8 per channel unless asked for int4, int4-rescored
(rescore_lm_head.py) or w8a8 (LmHead).
Every scheme but none also stores the embedding table as 8-bit blocks (quantize_embedding.py); gguf keeps a Q8_0 or
Q6_K table's own numbers there.
Under every int4 scheme a mixture-of-experts model's kiln.MoE experts become Q4_1 (quantize_moe.py; AWQ's scales
reach the attention projections only), under int8-weight-only Q8_0 (quantize_moe.py); under gguf and gguf-exact a
GGUF file's expert blocks stay as they are (quantize_moe_gguf.py); w8a8-smoothquant keeps them float32.
The build calls ``prepare_checkpoint`` before export (the gpt-fast-style conversion step:
check the artifact's fingerprint, fold its scales into the weights) and ``quantize_model``
on the optimized graph.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from kiln.errors import KilnError
from kiln.quant_scheme import LmHead, QuantMethod, QuantScheme

from .quant.graph import is_lm_head
from .quantize_embedding import quantize_embedding
from .quantize_gguf import quantize_gguf
from .quantize_int4 import quantize_int4
from .quantize_int8 import quantize_int8_weight_only
from .quantize_moe import quantize_moe_experts, quantize_moe_experts_q8_0
from .quantize_moe_gguf import keep_moe_gguf_experts
from .quantize_q4_1 import quantize_q4_1_pass
from .quantize_w8a8 import quantize_w8a8
from .rescore_lm_head import RESCORE_TOP_K, head_rows, rescore_lm_head

Progress = Callable[[str], None]


class QuantizationError(KilnError, ValueError):
    """A quantization option that cannot be built; the message says why."""


def check_options(scheme: QuantScheme, calibration: Path | None) -> None:
    """Fail before any work when the scheme and the artifact it folds in (or None) do not go together."""
    if scheme.calibration and calibration is None:
        raise QuantizationError(
            f"quantization {scheme} needs the scales of `kiln calibrate MODEL --method {scheme.calibration} "
            f"-o DIR`; pass that DIR as --calibration"
        )
    if calibration is not None and not scheme.calibration:
        raise QuantizationError(f"quantization {scheme} uses no calibration artifact; drop --calibration")


def check_lm_head(scheme: QuantScheme, lm_head: LmHead) -> None:
    """An int4 or w8a8 LM head only comes with an int4 scheme (the others quantize the head as every linear)."""
    if lm_head is not LmHead.INT8 and not scheme.is_int4:
        raise QuantizationError(f"an {lm_head.value} LM head goes with the int4 schemes (int4-rtn-*, int4-awq-*, "
                                f"int4-q4_1), not quantization {scheme}; drop --lm-head {lm_head.value}")


def prepare_checkpoint(checkpoint, scheme: QuantScheme, calibration: Path | None, progress: Progress | None = None):
    """The checkpoint to export: with the artifact's scales folded in when the scheme needs them."""
    check_options(scheme, calibration)
    if calibration is None:
        return checkpoint
    from kiln.calibration.artifact import CalibrationArtifact, CalibrationError, apply_artifact

    try:
        artifact = CalibrationArtifact.load(calibration)
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc
    if artifact.method != scheme.calibration:
        raise QuantizationError(
            f"quantization {scheme.name} needs {scheme.calibration} scales, "
            f"but {calibration} holds {artifact.method} scales"
        )
    group = artifact.hyperparameters.get("group_size")
    if scheme.group_size is not None and group != scheme.group_size:
        raise QuantizationError(
            f"the AWQ artifact {calibration} was searched for int4 groups of {group}, not {scheme.group_size}; "
            f"build with int4-awq-g{group} or recalibrate with --group-size {scheme.group_size}"
        )
    try:
        folded = apply_artifact(checkpoint, artifact)
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc
    if progress:  # the folded weights are a dict in memory: a calibrated build is not streamed
        progress(f"folded {artifact.method} scales from {calibration} (all weights in memory as fp32)")
    return folded


def int8_fallback(scheme: QuantScheme, calibration: Path | None) -> frozenset[str]:
    """The decoder linears an int4 AWQ artifact keeps int8 (`kiln calibrate --int8-fallback N`); none for the
    other schemes."""
    if calibration is None or scheme.method is not QuantMethod.INT4_AWQ:
        return frozenset()
    from kiln.calibration.artifact import CalibrationArtifact, CalibrationError

    try:
        return frozenset(CalibrationArtifact.load(calibration).hyperparameters.get("int8_linears", ()))
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc


def quantize_model(model: ir.Model, scheme: QuantScheme, lm_head: LmHead = LmHead.INT8,
                   progress: Progress | None = None, int8_modules: frozenset[str] = frozenset()) -> int:
    """Run the scheme's pass on the optimized graph in place; returns how many MatMuls it converted.
    int8_modules: decoder linears an int4 scheme keeps int8 per channel (int8_fallback)."""
    check_lm_head(scheme, lm_head)
    int4_head = lm_head.is_int4
    try:  # the head's float rows, read before the scheme's pass replaces the head
        rescored = head_rows(model) if lm_head is LmHead.INT4_RESCORED else None
    except ValueError as exc:
        raise QuantizationError(str(exc)) from exc
    if lm_head is LmHead.W8A8:  # first: the scheme's pass then no longer sees the head as a float linear
        heads = quantize_w8a8(model, select=is_lm_head)
        if progress:
            progress(f"  quantize_w8a8 (LM head): converted {heads} MatMuls")
    match scheme.method:
        case QuantMethod.NONE:
            return 0
        case QuantMethod.INT8_WEIGHT_ONLY:
            name, count = "quantize_int8", quantize_int8_weight_only(model)
        case QuantMethod.INT4_RTN | QuantMethod.INT4_AWQ:
            assert scheme.group_size is not None  # QuantScheme gives these methods a group size
            try:
                count = quantize_int4(model, scheme.group_size, int4_head, int8_modules)
            except ValueError as exc:
                raise QuantizationError(str(exc)) from exc
            name = "quantize_int4" + (f" ({len(int8_modules)} linears int8)" if int8_modules else "")
        case QuantMethod.INT4_Q4_1:
            name, count = "quantize_q4_1", quantize_q4_1_pass(model, int4_head)
        case QuantMethod.W8A8_SMOOTHQUANT:
            name, count = "quantize_w8a8", quantize_w8a8(model)
        case QuantMethod.GGUF | QuantMethod.GGUF_EXACT:
            counts = quantize_gguf(model, int8_activations=scheme.method is QuantMethod.GGUF)
            if counts.kept + counts.q4_1 == 0:
                raise QuantizationError(f"quantization {scheme} keeps a GGUF file's quantized blocks, and no linear "
                                        "of this model has blocks of a type kiln executes (Q4_0, Q4_1, Q5_0, Q5_1, "
                                        "Q8_0, Q4_K, Q5_K, Q6_K); choose another --quantization")
            name = (f"quantize_gguf ({counts.kept} on the file's blocks, {counts.q4_1} Q4_1, {counts.fallback} "
                    "without usable blocks: int8)")
            count = counts.total
            # kiln.MoE's experts: the file's blocks, activations as the linears'
            experts = keep_moe_gguf_experts(model, int8_activations=scheme.method is QuantMethod.GGUF)
            if progress and experts.kept + experts.float32 + experts.q4_1:
                progress(f"  keep_moe_gguf_experts: {experts.kept} layers' experts on the file's blocks, "
                         f"{experts.q4_1} Q4_0 as Q4_1, {experts.float32} float32 (blocks of a type kiln.MatMulGGUF "
                         "lacks, or none)")
    if progress:
        progress(f"  {name}: converted {count} MatMuls")
    if scheme.method in (QuantMethod.INT4_RTN, QuantMethod.INT4_AWQ, QuantMethod.INT4_Q4_1):
        layers = quantize_moe_experts(model)  # kiln.MoE's experts: Q4_1 under every int4 scheme
        if progress and layers:
            progress(f"  quantize_moe_experts: {layers} layers' experts to Q4_1")
    if scheme.method is QuantMethod.INT8_WEIGHT_ONLY:
        layers = quantize_moe_experts_q8_0(model)  # kiln.MoE's experts: Q8_0 GGUF experts, int8 activations
        if progress and layers:
            progress(f"  quantize_moe_experts_q8_0: {layers} layers' experts to Q8_0")
    if count == 0:
        raise QuantizationError(f"quantization {scheme} found no linear layer to convert in the graph")
    embeddings = quantize_embedding(model, file_blocks=scheme.method.keeps_file_blocks)
    if progress:
        progress(f"  quantize_embedding: converted {embeddings} Gathers")
    if rescored is not None:
        try:
            few_rows = rescore_lm_head(model, rescored)
        except ValueError as exc:
            raise QuantizationError(str(exc)) from exc
        if progress:
            steps = "every step" if few_rows is None else f"steps of up to {few_rows} rows (the int8 head above)"
            progress(f"  rescore_lm_head: the int4 head's top {RESCORE_TOP_K} logits from the 8-bit table, {steps}")
    return count
