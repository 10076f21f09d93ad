"""ONNX Runtime sessions of one-op models for the kernel benchmarks (bench_matmul_gguf.py, bench_matmul_q4_1.py,
bench_moe.py), on kiln's op library or another build of it."""

from __future__ import annotations

import onnxruntime as ort
from onnx import ModelProto

from kiln.runtime.ops import library_path


def op_session(model: bytes | ModelProto, threads: int, library: str | None = None) -> ort.InferenceSession:
    """A session of `model` with `threads` intra-op threads on `library` (default: the installed op library)."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(library or library_path())
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    # The benchmarks take turns between many sessions, and a session's pool threads spin on after its run by default:
    # on 2 cores they starved the next session's threads (a 2048 x 3072 Q4_K records call at 1 row timed 2.9 ms,
    # not 0.12).
    options.add_session_config_entry("session.force_spinning_stop", "1")
    serialized = model.SerializeToString() if isinstance(model, ModelProto) else model
    return ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
