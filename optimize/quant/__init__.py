"""Shared pieces of the weight-quantization passes: reference quantizers, packing, graph matching."""
