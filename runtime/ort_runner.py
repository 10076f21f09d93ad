"""ModelRunner for ONNX Runtime CPU: one session, per-layer KV pools bound once through IOBinding.

Each layer's pool is one OrtValue wrapping a numpy array, bound to both kv_cache.{i} and
kv_cache_out.{i}; kiln.PagedAttention writes the new tokens' K/V into it in place, so no
step ever copies a pool.

The one feeder of the engine graph: the runtime (runtime/loader.py, from an engine's
manifest), `kiln eval` and the tests' driver all open a session with `open_session` and
run their BatchInputs through an OrtModelRunner.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln import contract
from kiln import vision as vision_contract
from kiln.contract import ATTEND_UNTIL, KvPoolSpec
from kiln.manifest import EngineLoadError
from kiln.runtime.kv_memory import zeroed_pool
from kiln.runtime.kv_transfer import KvLayout
from kiln.runtime.model_runner import BatchInput, ModelRunner, RunnerOutput

_NO_ROWS = np.zeros(0, dtype=np.int64)
_CAUSAL = np.zeros(0, dtype=np.int32)  # attend_until of a step without a bidirectional image run


def open_session(graph: Path | bytes, num_threads: int | None = None,
                 library: str | None = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of an engine graph (a file, or a serialized model: the kernel benchmarks' one-op
    graphs), with the kiln op library registered (this install's, or `library`: another build of it, for a
    before/after)."""
    from kiln.runtime.ops import library_path

    options = ort.SessionOptions()
    options.register_custom_ops_library(library or library_path())
    if num_threads:
        options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    # The pool's threads spin between a run's parallel nodes (the step needs that: with spinning off it measured
    # 1.19x) but stop when the run ends, so the sampler's threads and the server get the cores between steps
    # (docs/design.md, "Sampler").
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3  # errors only: shape-hint warnings are noise here
    model = graph if isinstance(graph, bytes) else str(graph)
    try:
        return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises several unrelated types
        where = "a model in memory" if isinstance(graph, bytes) else graph
        raise EngineLoadError(f"onnxruntime cannot load {where} ({exc})") from exc


def graph_kv_pools(session: ort.InferenceSession) -> KvPoolSpec:
    """The KV pools a graph declares: one kv_cache.{i} input per layer, [num_blocks, 2, Hkv, block_size, D]."""
    inputs = {i.name: i for i in session.get_inputs()}
    first = inputs.get(contract.kv_cache_input(0))
    if first is None:
        raise EngineLoadError(f"the graph has no {contract.kv_cache_input(0)} input: it is not an engine graph")
    num_layers = next(i for i in range(len(inputs) + 1) if contract.kv_cache_input(i) not in inputs)
    # ORT's own type name of each KV dtype, e.g. "tensor(float)" for float32
    names = {ort.OrtValue.ortvalue_from_numpy(np.zeros(0, dtype)).data_type(): name
             for name, dtype in contract.KV_DTYPES.items()}
    if first.type not in names:
        raise EngineLoadError(f"{first.name} is a {first.type}, not one of the KV dtypes {list(contract.KV_DTYPES)}")
    try:
        _, _, num_kv_heads, block_size, head_dim = first.shape
        return KvPoolSpec(num_layers, num_kv_heads, block_size, head_dim, names[first.type])
    except ValueError as exc:
        raise EngineLoadError(f"{first.name} {first.shape} is not a KV pool with static dims ({exc})") from exc


class OrtModelRunner(ModelRunner):
    """Runs BatchInputs through a session of an engine graph with `num_blocks` blocks per layer pool."""

    def __init__(self, session: ort.InferenceSession, pools: KvPoolSpec, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        declared = graph_kv_pools(session)
        if declared != pools:
            raise EngineLoadError(f"the engine graph's KV pools are {declared}, not the {pools} it is described "
                                  f"with; rebuild the engine")
        outputs = {o.name: o for o in session.get_outputs()}
        medusa = outputs.get(contract.MEDUSA_LOGITS)
        heads_output = next((n for n in (contract.MEDUSA_LOGITS, contract.MEDUSA_HIDDEN) if n in outputs), None)
        fed = set(BatchInput.FEEDS) | {contract.kv_cache_input(i) for i in range(pools.num_layers)}
        if heads_output is not None:
            fed.add(contract.MEDUSA_INDICES)
        inputs = {i.name: i for i in session.get_inputs()}
        image_input = inputs.get(vision_contract.IMAGE_EMBEDS)
        if image_input is not None:
            fed |= {vision_contract.IMAGE_EMBEDS, vision_contract.IMAGE_ROWS}
        self._bounded = ATTEND_UNTIL in inputs  # Gemma 3's bidirectional image runs
        if self._bounded:
            fed.add(ATTEND_UNTIL)
        unknown = [i.name for i in session.get_inputs() if i.name not in fed]
        if unknown:
            raise EngineLoadError(f"engine graph inputs {unknown} are not fed by this runtime; rebuild the engine")
        vocab = session.get_outputs()[0].shape[-1]
        if not isinstance(vocab, int):
            raise EngineLoadError(f"the engine graph's {contract.LOGITS} output has no static vocabulary size "
                                  f"({vocab})")
        self.session = session
        self.pool_spec = pools
        self.num_blocks = num_blocks
        self.block_size = pools.block_size
        self.vocab_size = vocab
        self.num_medusa_heads = int(medusa.shape[1]) if medusa is not None else 0
        self.medusa_output = heads_output
        # a vision-language graph's image inputs: zero rows in a step without images
        self._no_images = None if image_input is None else (
            np.zeros((0, int(image_input.shape[1])), dtype=np.float32), np.zeros(0, dtype=np.int64))
        self.pools = [zeroed_pool(pools.pool_shape(num_blocks), pools.dtype) for _ in range(pools.num_layers)]
        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools]
        self.binding = session.io_binding()
        # outputs allocated per run, bound first so get_outputs() returns them first: logits (and the heads')
        self.binding.bind_output(contract.LOGITS, "cpu")
        if self.medusa_output is not None:
            self.binding.bind_output(self.medusa_output, "cpu")
        for i, value in enumerate(self._pool_values):
            self.binding.bind_ortvalue_input(contract.kv_cache_input(i), value)
            self.binding.bind_ortvalue_output(contract.kv_cache_output(i), value)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.pool_spec.bytes_per_block

    def execute(self, batch: BatchInput) -> np.ndarray:
        return self.execute_all(batch).logits

    def execute_all(self, batch: BatchInput) -> RunnerOutput:
        for name, array in batch.feeds().items():
            self.binding.bind_cpu_input(name, array)
        if self.medusa_output is not None:
            rows = _NO_ROWS if batch.medusa_indices is None else batch.medusa_indices
            self.binding.bind_cpu_input(contract.MEDUSA_INDICES, rows)
            self.binding.bind_output(self.medusa_output, "cpu")
        elif batch.medusa_indices is not None and len(batch.medusa_indices):
            raise ValueError("this engine has no Medusa heads (it was built without --medusa); "
                             "leave medusa_indices unset")
        self._bind_images(batch)
        self.binding.bind_output(contract.LOGITS, "cpu")
        self.session.run_with_iobinding(self.binding)
        # In binding order (rebinding a name keeps its place). The C-level vector: IOBinding.get_outputs wraps
        # every output, the 30 KV pools too, in a Python OrtValue, ~0.13 ms of a ~7 ms single-stream step.
        outputs = self.binding._iobinding.get_outputs()
        heads = outputs[1].numpy() if self.medusa_output is not None else None
        if self.medusa_output == contract.MEDUSA_HIDDEN:
            return RunnerOutput(outputs[0].numpy(), medusa_hidden=heads)
        return RunnerOutput(outputs[0].numpy(), heads)

    def _bind_images(self, batch: BatchInput) -> None:
        if self._no_images is None:
            if batch.image_rows is not None and len(batch.image_rows):
                raise ValueError("this engine's text graph takes no image embeddings (it is not a vision-language "
                                 "engine)")
            return
        if batch.image_embeds is None or batch.image_rows is None:
            embeds, rows = self._no_images
        else:
            embeds, rows = batch.image_embeds, batch.image_rows
        self.binding.bind_cpu_input(vision_contract.IMAGE_EMBEDS, embeds)
        self.binding.bind_cpu_input(vision_contract.IMAGE_ROWS, rows)
        if self._bounded:  # empty: causal
            self.binding.bind_cpu_input(ATTEND_UNTIL, _CAUSAL if batch.attend_until is None else batch.attend_until)
        elif batch.attend_until is not None:
            raise ValueError("this engine's text graph takes no attend_until (its images attend causally)")

    def kv_layout(self) -> KvLayout:
        return KvLayout(len(self.pools), self.pools[0].shape[1:], self.pools[0].dtype)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return read_pool_blocks(self.pools, block_ids)

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        write_pool_blocks(self.pools, block_ids, blocks)

    def close(self) -> None:
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()


def read_pool_blocks(pools: list[np.ndarray], block_ids: list[int]) -> np.ndarray:
    """[layers, blocks, ...]: the given blocks of every layer's pool, copied."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return np.stack([pool[ids] for pool in pools])


def write_pool_blocks(pools: list[np.ndarray], block_ids: list[int], blocks: np.ndarray) -> None:
    ids = np.asarray(block_ids, dtype=np.int64)
    for pool, layer in zip(pools, blocks, strict=True):
        pool[ids] = layer  # in place: the sessions' OrtValues wrap these arrays
