"""Small graph helpers shared by the fusions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer contents of a constant value (initializer or folded Constant), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return [int(x) for x in np.asarray(tensor.numpy()).reshape(-1)]


def const_float(value: ir.Value | None) -> float | None:
    """The value of a constant holding exactly one number, else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = np.asarray(tensor.numpy())
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def float_initializer(name: str, array: np.ndarray) -> ir.Value:
    """A float32 initializer value named `name` (register it on the graph)."""
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(array.shape)),
                    const_value=ir.tensor(np.ascontiguousarray(array, np.float32), name=name))


def empty_initializer(model: ir.Model, name: str, dtype: type = np.float32) -> ir.Value:
    """The graph's empty [0] initializer `name` (float32, or dtype), registered on first use: what kiln.PagedAttention
    takes in the place of an absent optional input before a present one."""
    found = model.graph.initializers.get(name)
    if found is not None:
        return found
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype))), shape=ir.Shape([0]),
                     const_value=ir.tensor(np.zeros(0, dtype), name=name))
    model.graph.register_initializer(value)
    return value


def is_last_axis(axis: int, value: ir.Value | None) -> bool:
    """axis (-1 or non-negative) names value's last axis; a non-negative one needs value's rank."""
    rank = None if value is None or value.shape is None else len(value.shape)
    return axis == -1 or (rank is not None and axis == rank - 1)


def static_dim(value: ir.Value, axis: int) -> int | None:
    if value.shape is None or len(value.shape) <= abs(axis):
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def producer_op(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node producing value if it is a default-domain op_type, else None."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def look_through_repeat_kv(value: ir.Value) -> ir.Value:
    """Undo Hugging Face's repeat_kv: Reshape(Expand(Unsqueeze(x, 2))) -> x ([B, Hkv, S, D])."""
    reshape = producer_op(value, "Reshape")
    expand = producer_op(reshape.inputs[0], "Expand") if reshape else None
    if expand is None:
        return value
    source = expand.inputs[0]
    unsqueeze = producer_op(source, "Unsqueeze")
    if unsqueeze is not None and const_ints(unsqueeze.inputs[1]) == [2]:
        return unsqueeze.inputs[0]
    return value


def add_opset(model: ir.Model, domain: str, version: int) -> None:
    model.opset_imports.setdefault(domain, version)
    model.graph.opset_imports.setdefault(domain, version)


def soft_cap_input(value: ir.Value) -> ir.Value | None:
    """x if value == Mul(Tanh(Div(x, c)), c) with one constant c (a Gemma soft-cap, as the export writes it)."""
    mul = producer_op(value, "Mul")
    tanh = producer_op(mul.inputs[0], "Tanh") if mul else None
    div = producer_op(tanh.inputs[0], "Div") if tanh else None
    if mul is None or div is None:
        return None
    cap = const_float(div.inputs[1])
    return div.inputs[0] if cap and cap == const_float(mul.inputs[1]) else None


def soft_cap_output(value: ir.Value) -> ir.Value | None:
    """The soft-cap's output when value's only reader starts one (soft_cap_input read forwards), else None."""
    uses = list(value.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Div":
        return None
    tanh_uses = list(uses[0].node.outputs[0].uses())
    if len(tanh_uses) != 1 or tanh_uses[0].node.op_type != "Tanh":
        return None
    mul_uses = list(tanh_uses[0].node.outputs[0].uses())
    if len(mul_uses) != 1:
        return None
    out = mul_uses[0].node.outputs[0]
    return out if soft_cap_input(out) is value else None


def prune_graph(source: onnx.GraphProto, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
                outputs: list[onnx.ValueInfoProto], keep: set[str]) -> onnx.GraphProto:
    """The graph of the nodes the outputs read, with only the inputs (and `keep`) and the source graph's
    initializers and value infos they use: what a pipeline stage or a tensor-parallel rank keeps of the one graph."""
    needed = {o.name for o in outputs} | keep
    kept = []
    for node in reversed(nodes):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(node.input)
    kept.reverse()
    return onnx.helper.make_graph(kept, source.name, [i for i in inputs if i.name in needed], outputs,
                                  initializer=[t for t in source.initializer if t.name in needed],
                                  value_info=[v for v in source.value_info if v.name in needed])


PAGE_BYTES = 4096  # external-data offsets on page boundaries: ONNX Runtime may map them


def write_weights(graph: onnx.GraphProto, source_dir: Path, data_path: Path, location: str,
                  inline_limit: int | None = None) -> None:
    """Each external initializer's bytes (read from source_dir) into data_path, page-aligned, and the tensor pointed
    at them; with inline_limit, also every in-graph tensor of at least that many raw bytes (moved out)."""
    offset = 0
    with open(data_path, "wb") as out:
        for tensor in graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = {entry.key: entry.value for entry in tensor.external_data}
                with open(source_dir / info["location"], "rb") as source:
                    source.seek(int(info.get("offset", 0)))
                    data = source.read(int(info["length"]))
            elif inline_limit is not None and len(tensor.raw_data) >= inline_limit:
                data = tensor.raw_data
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
            else:
                continue
            padding = -offset % PAGE_BYTES
            out.write(b"\0" * padding)
            offset += padding
            out.write(data)
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += len(data)
