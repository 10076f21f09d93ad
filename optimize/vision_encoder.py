"""The vision encoder graph's passes: exported vision.onnx -> the graph an engine ships.

The exported encoder's linear layers (CLIP's and SigLIP's q/k/v/out and fc1/fc2, the projectors' matrices) are
``MatMul(x, W^T)`` with W^T a [K, N] initializer and a constant bias Add where the layer has one: the form
the text graph's quantization passes find (optimize/quant/graph.find_linears). So the encoder takes the text
graph's passes as they are:

  fuse_projections   q/k/v reading one LayerNorm -> one MatMul over [K, 3H] and a Split (their biases too):
                     one kernel call, and under int8 one activation quantization instead of three
  cleanup            the optimizer's dead-code and Transpose/Reshape rules
  int8               quantize_w8a8: int8 weights per output channel and per-token int8 activations ->
                     MatMulIntegerToFloat (activations quantized once for q/k/v's shared input)
  int8-weight-only   quantize_int8_weight_only: int8 per output channel -> MatMulNBits (bits 8, the bias
                     folded in), activations quantized to int8 per block of 128 inside the kernel

Measured at CLIP ViT-L/14-336's shape (benchmarks/RESULTS.md): both a quarter of float32's bytes with ~3% relative
error in the embeddings; W8A8 0.7-0.8x float32's time per image, MatMulNBits 1.3-1.4x (ONNX Runtime's float
GEMM beats its 8-bit MatMulNBits at 577 rows on AVX2).

The patch convolution, position embeddings, norms and attention's activation-by-activation MatMuls are not
linears and stay float32.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from kiln.vision import EncoderQuantization

from .fuse_projections import fuse_projections
from .pipeline import cleanup
from .quantize_int8 import quantize_int8_weight_only
from .quantize_w8a8 import quantize_w8a8

_PASSES: dict[EncoderQuantization, Callable[[ir.Model], int]] = {
    EncoderQuantization.INT8: quantize_w8a8, EncoderQuantization.INT8_WEIGHT_ONLY: quantize_int8_weight_only}


class EncoderQuantizationError(ValueError):
    """The encoder graph cannot take the quantization asked for; the message says why."""


def optimize_encoder(model: ir.Model, quantization: EncoderQuantization) -> dict[str, int]:
    """Run the encoder's passes on model (in place); returns how often each fired."""
    counts = {"fuse_projections": fuse_projections(model)}
    cleanup(model)
    quantize = _PASSES.get(quantization)
    if quantize is not None:
        counts[quantize.__name__] = quantize(model)
        if not counts[quantize.__name__]:
            raise EncoderQuantizationError(f"--vision-quantization {quantization.value} found no linear layer in "
                                           "the image encoder graph to quantize")
    return counts
