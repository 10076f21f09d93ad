"""Pass: a vision-language engine's text graph takes image embeddings for its image-placeholder rows.

Two inputs join the graph (kiln/vision.py): ``image_embeds [N, hidden]`` float32 and ``image_rows [N]`` int64.
Right after the token-embedding Gather (float or GatherBlockQuantized: the pass runs on either) a ScatterND
writes row ``image_rows[i]`` of the embeddings with ``image_embeds[i]``; every reader of the embeddings reads
the scattered tensor instead. Nothing else changes: the fused attention, the norms, the KV pools and the LM
head are the text model's own, and a step without images passes N = 0 (ScatterND then copies the embeddings
through). LLaVA's embeddings are unscaled, so placing the scatter after the Gather is where transformers'
``masked_scatter`` puts the image features. Gemma 3 multiplies the token embeddings by sqrt(hidden) inside its
embedding module and scatters the image features into that module's output (Gemma3Model.forward), so the image
rows are not scaled: with ``after_scale`` the scatter goes after the Gather's Mul by the scale.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln import contract
from kiln import vision as vision_contract

_EMBEDDING_GATHERS = {("", "Gather"), ("ai.onnx", "Gather"), ("com.microsoft", "GatherBlockQuantized")}


class ImageInputsError(ValueError):
    """The graph has no token-embedding Gather to attach image inputs after."""


def _embedding_gather(graph: ir.Graph) -> ir.Node:
    """The Gather whose indices are the input_ids (directly or as the [1, T] view flatten_inputs makes)."""
    ids = next((v for v in graph.inputs if v.name == contract.INPUT_IDS), None)
    if ids is None:
        raise ImageInputsError(f"the graph has no {contract.INPUT_IDS} input")
    id_views = {ids} | {use.node.outputs[0] for use in ids.uses() if use.node.op_type == "Unsqueeze"}
    for node in graph:
        if (node.domain, node.op_type) in _EMBEDDING_GATHERS and node.inputs[1] in id_views:
            return node
    raise ImageInputsError("no Gather of the token-embedding table reads the input_ids")


def _is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return False
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _scale_after(gather: ir.Node) -> ir.Node:
    """The Mul by a constant that is the embedding Gather's only reader (Gemma's sqrt(hidden) scale)."""
    readers = list(gather.outputs[0].uses())
    node = readers[0].node if len(readers) == 1 else None
    if node is None or node.op_type != "Mul" or not any(_is_constant(v) for v in node.inputs):
        raise ImageInputsError("the token embeddings are not scaled by one constant Mul after their Gather "
                               "(the image rows go after the scale)")
    return node


def attach_image_inputs(model: ir.Model, hidden_size: int, after_scale: bool = False) -> int:
    """Add image_embeds / image_rows and the ScatterND after the embedding Gather (after_scale: after the Mul
    that scales its output); returns 1 (the fire count)."""
    graph = model.graph
    gather = _embedding_gather(graph)
    if after_scale:
        gather = _scale_after(gather)
    embedding = gather.outputs[0]
    readers = list(embedding.uses())
    embeds = ir.Value(name=vision_contract.IMAGE_EMBEDS, type=ir.TensorType(ir.DataType.FLOAT),
                      shape=ir.Shape(["num_image_rows", hidden_size]))
    rows = ir.Value(name=vision_contract.IMAGE_ROWS, type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape(["num_image_rows"]))
    graph.inputs.extend([embeds, rows])
    axis = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], dtype=np.int64))})
    rows_2d = ir.node("Unsqueeze", [rows, axis.outputs[0]])  # [N, 1]
    nodes = [axis, rows_2d]
    index = rows_2d.outputs[0]
    if embedding.shape is not None and len(embedding.shape) == 3:  # [1, T, hidden]: index (0, row)
        zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype=np.int64))})
        batch = ir.node("Mul", [index, zero.outputs[0]])
        pairs = ir.node("Concat", [batch.outputs[0], index], attributes={"axis": 1})
        nodes += [zero, batch, pairs]
        index = pairs.outputs[0]
    scatter = ir.node("ScatterND", [embedding, index, embeds], name="image_embeds.scatter")
    scatter.outputs[0].name = "embedding.with_images"
    scatter.outputs[0].shape = embedding.shape
    scatter.outputs[0].type = embedding.type
    graph.insert_after(gather, [*nodes, scatter])
    for node, slot in readers:
        node.replace_input_with(slot, scatter.outputs[0])
    return 1
