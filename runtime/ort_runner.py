"""ModelRunner for ONNX Runtime CPU: one session, per-layer KV pools bound once through IOBinding.

Each layer's pool is one OrtValue wrapping a numpy array, bound to both kv_cache.{i} and
kv_cache_out.{i}; kiln.PagedAttention writes the new tokens' K/V into it in place, so no
step ever copies a pool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln import contract
from kiln.manifest import EngineLoadError, Manifest
from kiln.runtime.model_runner import (
    KV_DTYPES, BatchInput, ModelRunner, choose_num_blocks, kv_bytes_per_block,
)
from kiln.runtime.params import RuntimeConfig


class OrtModelRunner(ModelRunner):
    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig, library_path: str) -> None:
        spec, build = manifest.spec, manifest.build
        if build.kv_dtype not in KV_DTYPES:
            raise EngineLoadError(
                f"engine KV dtype {build.kv_dtype!r} is not supported by the ONNX Runtime runner "
                f"(supported: {sorted(KV_DTYPES)})"
            )
        kv_dtype = KV_DTYPES[build.kv_dtype]
        self.block_size = build.block_size
        self.vocab_size = spec.vocab_size
        self.num_layers = spec.num_layers
        self.bytes_per_block = kv_bytes_per_block(
            spec.num_layers, spec.num_kv_heads, build.block_size, spec.head_dim, np.dtype(kv_dtype).itemsize
        )
        max_useful = config.max_num_seqs * -(-build.max_seq_len // build.block_size)
        self.num_blocks = choose_num_blocks(
            self.bytes_per_block, config.kv_cache_bytes, config.kv_cache_fraction, max_useful
        )
        options = ort.SessionOptions()
        options.register_custom_ops_library(library_path)
        if config.num_threads:
            options.intra_op_num_threads = config.num_threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only: shape-hint warnings are noise here
        try:
            self.session = ort.InferenceSession(
                str(Path(engine_dir) / "model.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001 - ORT raises several unrelated types
            raise EngineLoadError(f"onnxruntime cannot load {engine_dir}/model.onnx ({exc})") from exc
        fed = set(BatchInput.FEEDS) | {contract.kv_cache_input(i) for i in range(spec.num_layers)}
        unknown = [i.name for i in self.session.get_inputs() if i.name not in fed]
        if unknown:
            raise EngineLoadError(f"engine graph inputs {unknown} are not fed by this runtime; rebuild the engine")
        shape = contract.kv_pool_shape(self.num_blocks, spec.num_kv_heads, build.block_size, spec.head_dim)
        self.pools = [np.zeros(shape, dtype=kv_dtype) for _ in range(spec.num_layers)]
        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools]
        self.binding = self.session.io_binding()
        self.binding.bind_output(contract.LOGITS, "cpu")  # first output: logits, allocated per run
        for i, value in enumerate(self._pool_values):
            self.binding.bind_ortvalue_input(contract.kv_cache_input(i), value)
            self.binding.bind_ortvalue_output(contract.kv_cache_output(i), value)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def execute(self, batch: BatchInput) -> np.ndarray:
        for name, array in batch.feeds().items():
            self.binding.bind_cpu_input(name, array)
        self.binding.bind_output(contract.LOGITS, "cpu")
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0].numpy()

    def close(self) -> None:
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()
