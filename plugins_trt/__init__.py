"""TensorRT backend: the kiln.PagedAttention plugin and plan builder.

Not built yet; the ONNX Runtime CPU backend is the only one available.
"""
