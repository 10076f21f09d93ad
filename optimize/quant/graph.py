"""Finding the linear layers of an ONNX graph (onnx_ir) and swapping them for quantized nodes.

A linear layer is ``MatMul(activation, B)`` where B is a constant 2-D float weight:
  * an initializer ``W^T [K, N]`` (what the kiln exporter emits), or
  * ``Transpose(perm=[1, 0])`` of an initializer ``W [N, K]``: a tied LM head reading the
    embedding table. The Gather keeps the fp32 table; the head gets its own quantized copy.
An ``Add`` of a constant ``[N]`` bias that is the MatMul's only consumer is folded in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from kiln.export.lazy_initializers import MatrixRows
from kiln.export.tensor_files import FileBlocks
from kiln.optimize._common import soft_cap_output


@dataclass(frozen=True)
class Linear:
    matmul: ir.Node
    activation: ir.Value
    output: ir.Value  # what the replacement must produce (the bias Add's output if folded)
    source: ir.Value  # the initializer holding the weight: W^T [K, N], or W [N, K] behind a Transpose
    transposed: bool  # source holds W^T (the MatMul reads it directly)
    bias_add: ir.Node | None
    bias: ir.Value | None

    @property
    def name(self) -> str:
        return self.matmul.name or self.matmul.outputs[0].name

    @property
    def weight_name(self) -> str:
        """The initializer the weight comes from."""
        return self.source.name or ""

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the weight, without reading it."""
        assert self.source.const_value is not None
        rows, cols = (int(d) for d in self.source.const_value.shape)
        return (cols, rows) if self.transposed else (rows, cols)

    @property
    def file_blocks(self) -> tuple[FileBlocks, ...]:
        """W's rows as its file's quantized blocks, parts in row order (a GGUF's matrices; lazy_initializers.py),
        or () when the weight has none. Nothing is read."""
        return tuple(getattr(self.source.const_value, "blocks", ()))

    @property
    def weight(self) -> np.ndarray:
        """float32 [N, K], nn.Linear orientation, read from the initializer on every access (a build's
        initializers are lazy: read a linear's weight once, quantize it, let it go)."""
        tensor = self.source.const_value
        assert tensor is not None
        if self.transposed and isinstance(tensor, MatrixRows):  # W itself: no transposed copy of W^T
            return tensor.rows()
        array = tensor.numpy()
        return np.ascontiguousarray(array.T if self.transposed else array, dtype=np.float32)


def _is_default(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _is_float_matrix(value: ir.Value | None) -> bool:
    """value is a constant 2-D float32 tensor (its metadata only: nothing is read)."""
    if value is None or value.const_value is None:
        return False
    tensor = value.const_value
    return tensor.dtype == ir.DataType.FLOAT and len(tensor.shape) == 2


def _weight_source(b: ir.Value) -> tuple[ir.Value, bool] | None:
    """The initializer behind MatMul input B and whether it holds W^T; None when B is not a constant."""
    if _is_float_matrix(b):
        return b, True
    producer = b.producer()
    if producer is None or not _is_default(producer, "Transpose"):
        return None
    perm = producer.attributes.get("perm")
    if perm is not None and list(perm.as_ints()) != [1, 0]:
        return None
    source = producer.inputs[0]
    if source is None or not _is_float_matrix(source):
        return None
    return source, False


MODULES_KEY = "kiln.modules"  # metadata of a fused MatMul: the torch modules it computes, comma-separated


def linear_modules(node: ir.Node) -> tuple[str, ...]:
    """The torch modules (e.g. model.layers.3.mlp.down_proj) a linear MatMul computes: from the exporter's
    namespace metadata, or from fuse_projections' MODULES_KEY on a fused one; () when unknown."""
    fused = node.metadata_props.get(MODULES_KEY)
    if fused is not None:
        return tuple(m for m in fused.split(",") if m)
    scopes = node.metadata_props.get("namespace", "").split("/")
    modules = [s.split(": ")[0].strip() for s in scopes if s.endswith(": torch.nn.modules.linear.Linear")]
    return (modules[-1],) if modules else ()


def find_linears(model: ir.Model, min_size: int = 16) -> list[Linear]:
    """Every MatMul with a constant 2-D float weight (both dims >= min_size), in graph order. No weight is
    read: Linear.weight reads it when a pass asks."""
    found = []
    for node in model.graph:
        if not _is_default(node, "MatMul"):
            continue
        weight = _weight_source(node.inputs[1])
        if weight is None:
            continue
        source, transposed = weight
        lin = Linear(node, node.inputs[0], node.outputs[0], source, transposed, None, None)
        if min(lin.shape) < min_size:
            continue
        bias_add, bias = _bias_add(node, lin.shape[0])
        output = bias_add.outputs[0] if bias_add is not None else node.outputs[0]
        found.append(Linear(node, node.inputs[0], output, source, transposed, bias_add, bias))
    return found


# Split: with Medusa heads the LM head's rows are split into the logits (first part) and the heads' logits
_PASS_THROUGH = ("Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten", "Split")


def is_lm_head(lin: Linear) -> bool:
    """True when the linear's output reaches a graph output through shape-only ops and a final logit soft-cap
    (the LM head); through a Split, its first part is followed."""
    value = lin.output
    while True:
        if value.is_graph_output():
            return True
        capped = soft_cap_output(value)
        if capped is not None:
            value = capped
            continue
        uses = list(value.uses())
        if len(uses) != 1 or uses[0].node.op_type not in _PASS_THROUGH:
            return False
        value = uses[0].node.outputs[0]


def _bias_add(matmul: ir.Node, n: int) -> tuple[ir.Node | None, ir.Value | None]:
    out = matmul.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output():
        return None, None
    add = uses[0].node
    if not _is_default(add, "Add"):
        return None, None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    if other is not None and other.const_value is not None and tuple(other.const_value.shape) == (n,):
        return add, other
    return None, None


def initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    """Register a new initializer (name made unique) and return its value."""
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
    unique_name(model, value)
    value.const_value = ir.tensor(array, name=value.name)
    model.graph.register_initializer(value)
    return value


def lazy_initializer(model: ir.Model, name: str, shape: tuple[int, ...], compute: Callable[[], np.ndarray]) -> ir.Value:
    """Register a new uint8 initializer (name made unique) whose numbers `compute` gives when the engine writer reads
    them, so a pass never holds a model's converted weights at once."""
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.UINT8))
    unique_name(model, value)
    value.const_value = ir.LazyTensor(lambda: ir.tensor(compute()), ir.DataType.UINT8, ir.Shape(shape),
                                      name=value.name)
    model.graph.register_initializer(value)
    return value


def unique_name(model: ir.Model, value: ir.Value) -> None:
    """Give value its name, or name.1, name.2... when an initializer already has it."""
    existing = model.graph.initializers
    name = unique = value.name or ""
    i = 1
    while unique in existing:
        unique, i = f"{name}.{i}", i + 1
    value.name = unique


def replace_linear(model: ir.Model, lin: Linear, nodes: list[ir.Node], output: ir.Value) -> None:
    """Put nodes in place of the MatMul (and its folded bias Add); output takes over lin.output."""
    old_nodes = [lin.matmul] + ([lin.bias_add] if lin.bias_add is not None else [])
    ir.convenience.replace_nodes_and_values(
        model.graph, lin.matmul, old_nodes, nodes, [lin.output], [output]
    )


def prune(model: ir.Model) -> None:
    """Drop nodes and initializers nothing reads any more (old weights, orphaned Transposes)."""
    RemoveUnusedNodesPass()(model)


def ensure_opset(model: ir.Model, domain: str, version: int = 1) -> None:
    model.opset_imports.setdefault(domain, version)
    model.graph.opset_imports.setdefault(domain, version)


def onnx_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", 0)
