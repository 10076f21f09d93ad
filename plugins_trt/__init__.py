"""kiln's GPU path: Triton kernels for kiln.PagedAttention (kv_write.py, attention.py), their launch plan
(plan.py), a torch launcher (launcher.py), ahead-of-time PTX compilation (aot.py), and the TensorRT backend:
the kernels as TensorRT AOT plugins (trt_plugin.py, launch arithmetic in trt_launch.py) and the plan build
(trt_build.py). The TensorRT modules have not run anywhere yet (docs/design.md, "TensorRT backend").
"""
