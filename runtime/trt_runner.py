"""ModelRunner for TensorRT: a deserialized model.plan, device buffers allocated once, bindings bound once.

At load: one device pool per layer (cudaMalloc, zeroed), bound to both kv_cache.{i} and kv_cache_out.{i} (the
PagedKvWrite plugin's output is aliased to its pool input, so the step writes the new tokens' K/V in place);
one device buffer per feed and for the logits, sized for max_num_tokens, bound once. Per step: the feeds are
copied host -> device, set_input_shape gives TensorRT their shapes, execute_async_v3 runs the plan on the
runner's stream, and the logits rows come back device -> host. No step allocates or copies a pool.

Device memory and copies use cuda-python (cuda.bindings.runtime: no torch in the runtime); tensorrt and cuda
are imported when a runner is opened, never with the runtime package.

NOT RUN HERE: neither TensorRT nor a GPU was available where this was written (docs/design.md, "TensorRT
backend", lists the commands that verify it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kiln import contract
from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError, Manifest
from kiln.runtime.model_runner import BatchInput, ModelRunner

PLAN_FILE = "model.plan"


def _check(result: Any) -> Any:
    """cuda-python returns (error, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed with error {err}")
    return values[0] if len(values) == 1 else values


def device_free_bytes() -> int:
    """Free memory of the current CUDA device (the KV budget's 'available' for this backend)."""
    from cuda.bindings import runtime as cudart

    free, _total = _check(cudart.cudaMemGetInfo())
    return int(free)


class DeviceBuffer:
    """One cudaMalloc'd buffer for arrays of up to `shape` elements of dtype (freed by close)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        from cuda.bindings import runtime as cudart

        self.dtype = np.dtype(dtype)
        self.capacity = int(np.prod(shape))
        self.nbytes = self.capacity * self.dtype.itemsize
        self.ptr = int(_check(cudart.cudaMalloc(max(1, self.nbytes))))

    def upload(self, array: np.ndarray, stream: int) -> None:
        from cuda.bindings import runtime as cudart

        if array.size > self.capacity or array.dtype != self.dtype:
            raise ValueError(f"a {array.dtype} array of {array.size} elements does not fit a buffer of "
                             f"{self.capacity} {self.dtype}")
        array = np.ascontiguousarray(array)
        _check(cudart.cudaMemcpyAsync(self.ptr, array.ctypes.data, array.nbytes,
                                      cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))

    def download(self, out: np.ndarray, stream: int) -> None:
        from cuda.bindings import runtime as cudart

        _check(cudart.cudaMemcpyAsync(out.ctypes.data, self.ptr, out.nbytes,
                                      cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))

    def close(self) -> None:
        from cuda.bindings import runtime as cudart

        if self.ptr:
            cudart.cudaFree(self.ptr)
            self.ptr = 0


def check_plan(manifest: Manifest, trt_version: str, compute_capability: str) -> None:
    """A plan runs only on the TensorRT version and GPU architecture it was built with: one sentence otherwise."""
    plan = manifest.tensorrt
    if plan is None:
        raise EngineLoadError("the engine has no TensorRT plan: build it on this GPU machine with "
                              "`python -m kiln.plugins_trt.trt_build ENGINE_DIR`")
    if plan.version != trt_version:
        raise EngineLoadError(f"the engine's plan was built with TensorRT {plan.version}, but this machine has "
                              f"TensorRT {trt_version}; rebuild the plan here")
    if plan.compute_capability != compute_capability:
        raise EngineLoadError(f"the engine's plan was built for GPU architecture sm {plan.compute_capability}, but "
                              f"this GPU is sm {compute_capability}; rebuild the plan here")


class TrtModelRunner(ModelRunner):
    """Runs BatchInputs through an engine's TensorRT plan with `num_blocks` blocks per layer pool."""

    def __init__(self, engine_dir: Path, manifest: Manifest, pools: KvPoolSpec, num_blocks: int) -> None:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart

        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        props = _check(cudart.cudaGetDeviceProperties(0))
        check_plan(manifest, trt.__version__, f"{props.major}.{props.minor}")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((engine_dir / PLAN_FILE).read_bytes())
        if self.engine is None:
            raise EngineLoadError(f"TensorRT cannot deserialize {engine_dir / PLAN_FILE}")
        self.context = self.engine.create_execution_context()
        self.stream = int(_check(cudart.cudaStreamCreate()))
        self.pool_spec, self.num_blocks, self.block_size = pools, num_blocks, pools.block_size
        self.vocab_size = int(self.engine.get_tensor_shape(contract.LOGITS)[-1])
        tokens = manifest.build.max_num_tokens
        width = -(-manifest.max_seq_len // pools.block_size)
        capacity = {contract.INPUT_IDS: ((tokens,), np.int64), contract.POSITION_IDS: ((tokens,), np.int64),
                    contract.QUERY_START_LOC: ((tokens + 1,), np.int32), contract.SEQ_LENS: ((tokens,), np.int32),
                    contract.BLOCK_TABLES: ((tokens, width), np.int32),
                    contract.LOGITS_INDICES: ((tokens,), np.int64)}
        self.feeds = {name: DeviceBuffer(shape, np.dtype(dtype)) for name, (shape, dtype) in capacity.items()}
        self.logits = DeviceBuffer((tokens, self.vocab_size), np.dtype(np.float32))
        self.pools = [DeviceBuffer(pools.pool_shape(num_blocks), pools.dtype) for _ in range(pools.num_layers)]
        for name, buffer in self.feeds.items():
            self.context.set_tensor_address(name, buffer.ptr)
        self.context.set_tensor_address(contract.LOGITS, self.logits.ptr)
        for i, pool in enumerate(self.pools):
            _check(cudart.cudaMemsetAsync(pool.ptr, 0, pool.nbytes, self.stream))
            self.context.set_input_shape(contract.kv_cache_input(i), pools.pool_shape(num_blocks))
            self.context.set_tensor_address(contract.kv_cache_input(i), pool.ptr)
            self.context.set_tensor_address(contract.kv_cache_output(i), pool.ptr)  # aliased: written in place
        _check(cudart.cudaStreamSynchronize(self.stream))

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.pool_spec.bytes_per_block

    def execute(self, batch: BatchInput) -> np.ndarray:
        from cuda.bindings import runtime as cudart

        for name, array in batch.feeds().items():
            self.feeds[name].upload(array, self.stream)
            self.context.set_input_shape(name, array.shape)
        if not self.context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT failed to run the step (its log says why)")
        logits = np.empty((len(batch.logits_indices), self.vocab_size), np.float32)
        self.logits.download(logits, self.stream)
        _check(cudart.cudaStreamSynchronize(self.stream))
        return logits

    def close(self) -> None:
        from cuda.bindings import runtime as cudart

        for buffer in [*self.feeds.values(), self.logits, *self.pools]:
            buffer.close()
        if self.stream:
            cudart.cudaStreamDestroy(self.stream)
            self.stream = 0
