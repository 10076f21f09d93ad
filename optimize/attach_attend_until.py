"""Pass: a Gemma 3 vision-language engine's attention lets the tokens of one image see each other.

One graph input joins: ``attend_until`` int32 [num_tokens] (kiln/paged_attention.py: the last position each
token of the packed batch may see), fed to every kiln.PagedAttention node as its 11th input. An op without
kv_scale or RoPE inside gets the empty float32 initializers NO_KV_SCALE / NO_ROTARY in those places, so the
input lands in its slot (an op's q_norm / k_norm after it stay). The runtime binds the causal bounds (each
token's own position) or an empty tensor in a step without image tokens, and an image run's last position for
its tokens.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln import contract
from kiln.contract import ATTEND_UNTIL
from kiln.optimize._common import empty_initializer
from kiln.paged_attention import NO_KV_SCALE, NO_ROTARY

_OPTIONAL_BEFORE = 10  # query .. query_start_loc, kv_scale, cos_cache, sin_cache


def attach_attend_until(model: ir.Model) -> int:
    """Add the attend_until input to every PagedAttention node; returns how many took it."""
    graph = model.graph
    nodes = [n for n in graph if n.domain == contract.OP_DOMAIN and n.op_type == contract.OP_TYPE]
    if not nodes:
        return 0
    until = ir.Value(name=ATTEND_UNTIL, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape(["num_until"]))
    graph.inputs.append(until)
    for node in nodes:
        inputs = list(node.inputs)[:_OPTIONAL_BEFORE]
        later = list(node.inputs)[_OPTIONAL_BEFORE + 1:]  # q_norm / k_norm, after an empty attend_until
        if len(inputs) < 8:
            inputs.append(empty_initializer(model, NO_KV_SCALE))
        while len(inputs) < _OPTIONAL_BEFORE:
            inputs.append(empty_initializer(model, NO_ROTARY))
        node.resize_inputs(_OPTIONAL_BEFORE + 1 + len(later))
        for slot, value in enumerate([*inputs, until, *later]):
            if node.inputs[slot] is not value:
                node.replace_input_with(slot, value)
    return len(nodes)
