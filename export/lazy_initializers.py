"""Tracing without the weights: placeholders in, lazy initializers out.

The exporter (torch.onnx, dynamo) needs a module with real tensors, and its graph optimizer folds
``Transpose(W)`` of every linear weight into a ``W^T`` initializer. Neither needs the numbers: tracing
runs on fake tensors, and numpy folds a Transpose into a view. So every matrix enters the export as an
uninitialised placeholder (``torch.empty``: address space, no pages touched), and afterwards each
initializer still backed by a placeholder's memory (the parameter itself, or a transposed view of it)
becomes an ``ir.LazyTensor`` that reads the checkpoint's tensor, transposed as the view was, when a pass
or the engine writer asks for it. The graph, its names and its initializer order are the exporter's own,
so the engine is the one a fully materialised export gives, bit for bit. Vectors (norm gains, biases) are
read for real: they are small, and the exporter's rewrite rules may look at their values. Small matrices are
placeholders that hold their own numbers (a copy, read when the export starts): the exporter's optimizer merges
initializers of at most 1024 elements whose bytes are equal, and an uninitialised placeholder's bytes are whatever
the allocator's memory held, so two that happened to hold the same bytes (zeroed pages, or the same freed data)
became one and a layer read another layer's weight (a tiny Qwen2-MoE's routers, after other builds in the process).
Stacked [E, ...] expert weights (kiln.MoE's inputs) are placeholders too, never transposed.

A matrix read from a GGUF also carries its file's blocks (``blocks``: the rows as the file's quantized bytes), so
`--quantization gguf` can hand them to kiln.MatMulGGUF as they are instead of re-rounding the float rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from .checkpoint_types import LazyWeights, weight_shape
from .tensor_files import FileBlocks

# Matrices of at most this many elements enter the export holding their numbers: the exporter's optimizer compares
# tensors this small by value (onnxscript's DeduplicateInitializersPass, size_limit 1024; a unit test holds this
# bound to theirs).
FILLED_AT_MOST = 1024


@dataclass(frozen=True)
class _Placeholder:
    name: str  # the checkpoint weight it stands for
    tensor: torch.Tensor

    @property
    def filled(self) -> bool:
        """Holds the weight's numbers (a small matrix), not uninitialised memory."""
        return self.tensor.numel() <= FILLED_AT_MOST


def placeholder_weights(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[_Placeholder]]:
    """The state dict to trace with: matrices as placeholders (untouched, or a copy of a small one), vectors read."""
    state: dict[str, torch.Tensor] = {}
    placeholders = []
    for name in weights:
        shape = weight_shape(weights, name)
        if len(shape) >= 2 and min(shape) > 1:  # a [1, D] row (Qwen2-MoE's shared expert gate) is a vector
            # a small one is a copy: its own memory, which only the export's views of it share
            tensor = (weights[name].to(torch.float32, copy=True).contiguous() if math.prod(shape) <= FILLED_AT_MOST
                      else torch.empty(shape, dtype=torch.float32))
            placeholders.append(_Placeholder(name, tensor))
            state[name] = tensor
        else:
            state[name] = weights[name]
    return state, placeholders


class MatrixRows(ir.LazyTensor):
    """A lazy ``W^T [K, N]`` initializer (a linear's weight as a MatMul reads it) whose ``W [N, K]`` can also be
    read directly: the quantizers want W, and a transposed copy of a large matrix is memory a build need not
    hold. rows() returns W as float32, C-contiguous. blocks: W's rows as file blocks, parts stacked in row order
    (one part, or a fused projection's), empty when any part has none."""

    __slots__ = ("_rows", "blocks")

    def __init__(self, rows: Callable[[], np.ndarray], n: int, k: int, name: str | None = None,
                 blocks: tuple[FileBlocks, ...] = ()) -> None:
        self._rows = rows
        self.blocks = blocks
        super().__init__(self._transposed, ir.DataType.FLOAT, ir.Shape([k, n]), name=name)

    def rows(self) -> np.ndarray:
        return self._rows()

    def _transposed(self) -> ir.Tensor:
        return ir.tensor(np.ascontiguousarray(self._rows().T))


class BlockRows(ir.LazyTensor):
    """A lazy ``W [N, K]`` initializer kept as it is (an embedding table, which a tied LM head reads through a
    Transpose), with W's rows as file blocks like MatrixRows.blocks; or a kiln.MoE expert stack [E, rows, K], whose
    blocks are its parts along rows (down's one, or gate_up's gate and up), each part's rows every expert's."""

    __slots__ = ("blocks",)

    def __init__(self, read: Callable[[], np.ndarray], shape: tuple[int, ...], name: str | None = None,
                 blocks: tuple[FileBlocks, ...] = ()) -> None:
        self.blocks = blocks
        super().__init__(lambda: ir.tensor(read()), ir.DataType.FLOAT, ir.Shape(shape), name=name)


class LazyInitializerError(RuntimeError):
    """The exporter did something with a weight other than keep or transpose it."""


def attach_lazy_weights(model: ir.Model, weights: Mapping[str, torch.Tensor],
                        placeholders: list[_Placeholder]) -> int:
    """Swap every placeholder-backed initializer for a LazyTensor over the checkpoint; returns how many."""
    by_address = {p.tensor.data_ptr(): p for p in placeholders}
    swapped = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        array = _backing_array(tensor)
        if array is None or array.ndim not in (2, 3):  # matrices, and the [E, ...] stacks of MoE experts
            continue
        address = array.__array_interface__["data"][0]
        placeholder = by_address.get(address)
        if placeholder is None:
            continue
        shape = tuple(placeholder.tensor.shape)
        if array.shape == shape and array.flags.c_contiguous:
            transpose = False
        elif array.ndim == 2 and array.shape == shape[::-1] and array.T.flags.c_contiguous:
            transpose = True
        else:
            raise LazyInitializerError(f"initializer {value.name} views weight {placeholder.name} "
                                       f"{list(shape)} as {list(array.shape)} with strides {array.strides}")
        read = _reader(weights, placeholder.name)
        blocks = _file_blocks(weights, placeholder.name)
        value.const_value = (MatrixRows(read, *shape, name=tensor.name, blocks=blocks) if transpose else
                             BlockRows(read, shape, name=tensor.name, blocks=blocks))
        swapped += 1
    _check_no_placeholder_left(model, placeholders)
    return swapped


def _file_blocks(weights: Mapping[str, torch.Tensor], name: str) -> tuple[FileBlocks, ...]:
    """A weight's file blocks: one part, or an expert stack's gate and up parts; () without blocks."""
    found = weights.file_blocks(name) if isinstance(weights, LazyWeights) else None
    if isinstance(found, FileBlocks):
        return (found,)
    if isinstance(found, tuple) and all(isinstance(part, FileBlocks) for part in found):
        return found
    return ()


def _backing_array(tensor: ir.TensorProtocol | None) -> np.ndarray | None:
    """The numpy array behind an in-memory initializer without copying it (None for other kinds)."""
    if tensor is None or isinstance(tensor, ir.LazyTensor):
        return None
    raw = getattr(tensor, "raw", None)
    if isinstance(raw, torch.Tensor):
        return raw.detach().numpy() if raw.dtype == torch.float32 and raw.device.type == "cpu" else None
    return raw if isinstance(raw, np.ndarray) else None


def _reader(weights: Mapping[str, torch.Tensor], name: str) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        return np.ascontiguousarray(weights[name].numpy(), dtype=np.float32)
    return read


def _check_no_placeholder_left(model: ir.Model, placeholders: list[_Placeholder]) -> None:
    """Any other initializer of an unfilled placeholder's size was computed from uninitialised memory: refuse it."""
    sizes = {p.tensor.numel() for p in placeholders if not p.filled}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and not isinstance(tensor, ir.LazyTensor) and tensor.size in sizes:
            raise LazyInitializerError(f"initializer {value.name} {list(tensor.shape)} was computed from a weight "
                                       "placeholder; the exporter transformed a weight beyond a transpose")


def as_if_loaded(model: ir.Model) -> ir.Model:
    """The model as saving and loading it would give (its graph through a proto, the lazy weights kept): the
    names the optimizer's passes then give new nodes and values ("val_0", "node_Constant_0") are the ones an
    export written to disk and read back gets, so the engine is that build's to the byte."""
    lazy = {name: value.const_value for name, value in model.graph.initializers.items()
            if isinstance(value.const_value, ir.LazyTensor)}
    for name, tensor in lazy.items():  # serialized as a reference: nothing is read
        model.graph.initializers[name].const_value = ir.ExternalTensor(
            "lazy", 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=name)
    try:
        loaded = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    finally:
        for name, tensor in lazy.items():
            model.graph.initializers[name].const_value = tensor
    for name, tensor in lazy.items():
        loaded.graph.initializers[name].const_value = tensor
    return loaded
