"""Trace the reference model to ONNX with standard ops (torch.onnx.export, dynamo exporter).

The graph takes ``input_ids [1, T]`` and ``position_ids [1, T]`` int64 (T dynamic) and
returns ``logits [1, T, V]`` float32; attention stays a recognisable
matmul -> scale -> +mask -> softmax -> matmul subgraph for kiln.optimize to fuse.
``export_model`` returns the graph in memory with its weight matrices as lazy initializers
(export/lazy_initializers.py: the trace never holds the weights); ``export_onnx`` writes it,
weights to ``<name>.data`` (external data) beside the graph, one tensor at a time.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

import onnx_ir as ir
import torch
from tqdm import tqdm

from kiln import contract
from kiln.export.checkpoint_types import Checkpoint
from kiln.export.lazy_initializers import as_if_loaded, attach_lazy_weights, placeholder_weights
from kiln.export.moe import MOE_TRANSLATION
from kiln.export.progress import progress_bar
from kiln.export.reference import ReferenceModel

Progress = Callable[[str], None]

# The trace length: anything > 1 keeps T symbolic (torch specialises sizes 0 and 1).
_EXAMPLE_TOKENS = 8


def export_onnx(checkpoint: Checkpoint, out_path: str | Path, progress: Progress | None = None) -> Path:
    """Write the raw graph (+ external weights) to out_path; returns out_path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = export_model(checkpoint, progress)
    data = out_path.with_name(out_path.name + ".data")
    for path in (out_path, data):
        if path.exists():
            path.unlink()
    ir.save(model, out_path, external_data=data.name)
    return out_path


def export_model(checkpoint: Checkpoint, progress: Progress | None = None) -> ir.Model:
    """The raw graph, its weight matrices read from the checkpoint only when a pass or writer asks."""
    say = progress or (lambda _msg: None)
    state, placeholders = placeholder_weights(checkpoint.weights)
    model = ReferenceModel(checkpoint.spec, state).eval()
    input_ids = torch.zeros((1, _EXAMPLE_TOKENS), dtype=torch.int64)
    position_ids = torch.arange(_EXAMPLE_TOKENS, dtype=torch.int64)[None]
    tokens = torch.export.Dim("T", min=1)  # no max: a packed step may exceed max_position_embeddings
    start = time.perf_counter()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" etc.
    layers = list(model.model.layers)
    with progress_bar("export onnx", len(layers) + len(_EXPORTER_PHASES) + 1) as bar:
        hooks = [layer.register_forward_pre_hook(_count_traced(bar, i, len(layers))) for i, layer in enumerate(layers)]
        try:
            with warnings.catch_warnings(), torch.no_grad(), redirect_stdout(_ExporterPhases(bar)):
                warnings.simplefilter("ignore")  # the exporter's deprecation chatter
                program = torch.onnx.export(
                    model,
                    (input_ids, position_ids),
                    input_names=[contract.INPUT_IDS, contract.POSITION_IDS],
                    output_names=["logits"],
                    dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens}},
                    dynamo=True,
                    custom_translation_table=MOE_TRANSLATION,  # kiln::moe -> kiln.MoE (export/moe.py)
                    optimize=True,
                    verbose=True,  # its phase lines go to _ExporterPhases, which shows them as the bar's steps
                )
        finally:
            for hook in hooks:
                hook.remove()
        say(f"traced in {time.perf_counter() - start:.1f}s")
        bar.set_postfix_str("lazy weights")
        attach_lazy_weights(program.model, checkpoint.weights, placeholders)
        model = as_if_loaded(program.model)
        bar.update(1)
    return model


# The exporter's phases after tracing, as its verbose output names them ("[torch.onnx] <phase>... ✅").
_EXPORTER_PHASES = ("Run decompositions", "Translate the graph into ONNX", "Optimize the ONNX graph")


def _count_traced(bar: tqdm, index: int, num_layers: int) -> Callable[..., None]:
    def hook(*_args: object) -> None:
        if bar.n < num_layers:  # a retried trace strategy would run the layers again
            bar.set_postfix_str(f"trace layer {index + 1}/{num_layers}")
            bar.update(1)
    return hook


class _ExporterPhases(io.TextIOBase):
    """Stands in for stdout during the export: a finished phase of the exporter's verbose lines advances
    the bar, the start of one names it, the rest is dropped (as verbose=False would)."""

    def __init__(self, bar: tqdm) -> None:
        super().__init__()
        self._bar, self._pending = bar, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            message = line.removeprefix("[torch.onnx]").strip()
            if message.removesuffix("... ✅") in _EXPORTER_PHASES:
                self._bar.update(1)
            elif message.removesuffix("...") in _EXPORTER_PHASES:
                self._bar.set_postfix_str(message.removesuffix("..."))
        return len(text)
