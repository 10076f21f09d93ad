"""Trace the reference model to ONNX with standard ops (torch.onnx.export, dynamo exporter).

The graph takes ``input_ids [1, T]`` and ``position_ids [1, T]`` int64 (T dynamic) and
returns ``logits [1, T, V]`` float32; attention stays a recognisable
matmul -> scale -> +mask -> softmax -> matmul subgraph for kiln.optimize to fuse.
Weights go to ``<name>.data`` (external data) beside the graph.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from kiln import contract
from kiln.export.checkpoint_types import Checkpoint
from kiln.export.reference import ReferenceModel

Progress = Callable[[str], None]

# The trace length: anything > 1 keeps T symbolic (torch specialises sizes 0 and 1).
_EXAMPLE_TOKENS = 8


def export_onnx(checkpoint: Checkpoint, out_path: str | Path, progress: Progress | None = None) -> Path:
    """Write the raw graph (+ external weights) to out_path; returns out_path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    model = ReferenceModel.from_checkpoint(checkpoint).eval()
    input_ids = torch.zeros((1, _EXAMPLE_TOKENS), dtype=torch.int64)
    position_ids = torch.arange(_EXAMPLE_TOKENS, dtype=torch.int64)[None]
    tokens = torch.export.Dim("T", min=1)  # no max: a packed step may exceed max_position_embeddings
    start = time.perf_counter()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" etc.
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter
        program = torch.onnx.export(
            model,
            (input_ids, position_ids),
            input_names=[contract.INPUT_IDS, contract.POSITION_IDS],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens}},
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    say(f"traced in {time.perf_counter() - start:.1f}s")
    if out_path.exists():
        out_path.unlink()
    data = out_path.with_name(out_path.name + ".data")
    if data.exists():
        data.unlink()
    program.save(str(out_path), external_data=True)
    return out_path
