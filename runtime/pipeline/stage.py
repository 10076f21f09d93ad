"""One pipeline stage: an ONNX Runtime session of its graph and the KV pools of its layers.

A stage binds the BatchInput feeds its graph declares (a later stage reads no input_ids, only the last reads
logits_indices), its layers' pools once (bound to kv_cache.{i} and kv_cache_out.{i}: written in place, as in
the single-graph runner), and `hidden_states` from the previous stage. It returns the residual stream after its
last layer, or, for the last stage, the logits (and the Medusa heads' output where the engine has heads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from kiln import contract
from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError
from kiln.pipeline_stages import HIDDEN_STATES, HIDDEN_STATES_OUT, PipelineStage
from kiln.runtime.kv_memory import zeroed_pool
from kiln.runtime.model_runner import BatchInput, RunnerOutput
from kiln.runtime.ort_runner import read_pool_blocks, write_pool_blocks
from kiln.runtime.pipeline.shape import PipelineShape

_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class StageResult:
    """What one stage's run returns: the next stage's hidden states, or (last stage) the step's output."""

    hidden: np.ndarray | None  # float32 [num_tokens, hidden_size]
    output: RunnerOutput | None
    seconds: tuple[float, ...]  # each stage's own time so far (its bindings and session run), in stage order
    bytes_moved: int  # hidden-state bytes handed from stage to stage so far


class StageRunner:
    """Runs BatchInputs through one stage's session, num_blocks blocks in each of its layers' pools."""

    def __init__(self, session: ort.InferenceSession, stage: PipelineStage, pools: KvPoolSpec,
                 num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        kv_inputs = {name for name in inputs if name.startswith("kv_cache.")}
        expected = {contract.kv_cache_input(i) for i in stage.layers}
        if kv_inputs != expected:
            raise EngineLoadError(f"pipeline stage {stage.graph} has the KV pools {sorted(kv_inputs)}, not those of "
                                  f"its layers {stage.first_layer}..{stage.end_layer - 1}; rebuild the engine")
        self.is_last = contract.LOGITS in outputs
        if not self.is_last and HIDDEN_STATES_OUT not in outputs:
            raise EngineLoadError(f"pipeline stage {stage.graph} outputs neither {contract.LOGITS} nor "
                                  f"{HIDDEN_STATES_OUT}; rebuild the engine")
        self.reads_hidden = HIDDEN_STATES in inputs
        self.feeds = [name for name in BatchInput.FEEDS if name in inputs]
        self.medusa_output = next((n for n in (contract.MEDUSA_LOGITS, contract.MEDUSA_HIDDEN) if n in outputs), None)
        self.session, self.stage, self.num_blocks = session, stage, num_blocks
        self.load_resident_bytes = 0  # open_stage measures it
        self.pools = [zeroed_pool(pools.pool_shape(num_blocks), pools.dtype) for _ in stage.layers]
        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools]
        self.binding = session.io_binding()
        self._first_output = contract.LOGITS if self.is_last else HIDDEN_STATES_OUT
        self.binding.bind_output(self._first_output, "cpu")  # bound first: get_outputs() returns it first
        if self.medusa_output is not None:
            self.binding.bind_output(self.medusa_output, "cpu")
        for layer, value in zip(stage.layers, self._pool_values, strict=True):
            self.binding.bind_ortvalue_input(contract.kv_cache_input(layer), value)
            self.binding.bind_ortvalue_output(contract.kv_cache_output(layer), value)

    @property
    def output_width(self) -> int:
        """The vocabulary (last stage) or the hidden size (others), as the graph declares it."""
        width = next(o for o in self.session.get_outputs() if o.name == self._first_output).shape[-1]
        if not isinstance(width, int):
            raise EngineLoadError(f"pipeline stage {self.stage.graph}'s {self._first_output} has no static width")
        return width

    def shape(self, num_blocks: int) -> PipelineShape:
        """What the pipeline's runner reports, read off this (last) stage's graph."""
        heads = 0
        if self.medusa_output == contract.MEDUSA_LOGITS:
            heads = int(next(o for o in self.session.get_outputs() if o.name == contract.MEDUSA_LOGITS).shape[1])
        return PipelineShape(num_blocks, self.output_width, heads, self.medusa_output)

    def run(self, batch: BatchInput, previous: StageResult | None) -> StageResult:
        """This stage's step on batch, after `previous` (None for the first stage)."""
        start = time.perf_counter()
        seconds, moved = (previous.seconds, previous.bytes_moved) if previous is not None else ((), 0)
        if self.reads_hidden:
            if previous is None or previous.hidden is None:
                raise ValueError(f"pipeline stage {self.stage.graph} needs the previous stage's hidden states")
            self.binding.bind_cpu_input(HIDDEN_STATES, previous.hidden)
            moved += previous.hidden.nbytes
        feeds = batch.feeds()
        for name in self.feeds:
            self.binding.bind_cpu_input(name, feeds[name])
        if self.medusa_output is not None:
            rows = _NO_ROWS if batch.medusa_indices is None else batch.medusa_indices
            self.binding.bind_cpu_input(contract.MEDUSA_INDICES, rows)
            self.binding.bind_output(self.medusa_output, "cpu")
        self.binding.bind_output(self._first_output, "cpu")
        self.session.run_with_iobinding(self.binding)
        outputs = self.binding._iobinding.get_outputs()  # in binding order (see ort_runner.py)
        first = outputs[0].numpy()
        if not self.is_last:
            return StageResult(first, None, (*seconds, time.perf_counter() - start), moved)
        heads = outputs[1].numpy() if self.medusa_output is not None else None
        output = (RunnerOutput(first, medusa_hidden=heads) if self.medusa_output == contract.MEDUSA_HIDDEN
                  else RunnerOutput(first, heads))
        return StageResult(None, output, (*seconds, time.perf_counter() - start), moved)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return read_pool_blocks(self.pools, block_ids)

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        write_pool_blocks(self.pools, block_ids, blocks)

    def close(self) -> None:
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()
