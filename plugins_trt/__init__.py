"""kiln's GPU path: Triton kernels for kiln.PagedAttention (kv_write.py, attention.py), their launch plan
(plan.py), a torch launcher (launcher.py) and ahead-of-time PTX compilation (aot.py).

The TensorRT plugin and plan builder that will embed these kernels are not written yet; the ONNX Runtime CPU
backend is the only one that serves engines (docs/design.md, "GPU path").
"""
