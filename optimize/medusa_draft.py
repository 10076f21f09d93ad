"""The draft graph of hydra heads (kiln/medusa.py): the chain the runtime runs after a step.

    idx   = draft_index[token]                        the token's row of the draft vocabulary (V' = outside it)
    for i in 1..K:
        s   = s + SiLU(s A_i^T + token_term_i[idx]) C_i^T     token_term_i = embed' B_i^T + b_i, precomputed
        idx = ArgMax(s lm_head'^T)                    over the draft vocabulary only
        draft_tokens[:, i-1] = vocab[idx]
        draft_confidence[:, i-1] = 1 / sum(exp(logits - max(logits)))    the guess's softmax probability

embed' holds the input embedding's rows of the draft vocabulary and a zero row for any other token. A
decode step runs the chain for a handful of rows on a cold cache, so what it costs is the bytes it reads:
the token term is a gathered row of a float16 table (folding B_i and b_i in saves a D x D read per head),
A_i, C_i and lm_head' are 8-bit MatMulNBits (a guess needs only an argmax; 8 bits keep the head table a quarter
of float32's and in the last-level cache between the K reads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln import medusa
from kiln.optimize.quant.graph import initializer
from kiln.optimize.quant.nbits import MS_DOMAIN, make_matmul_nbits
from kiln.optimize.quant.rtn import GroupQuantized, quantize_groupwise

WEIGHT_BITS = 8
WEIGHT_GROUP = 32


def build_draft_graph(heads: list[tuple[np.ndarray, ...]], vocab: np.ndarray,
                      embed: np.ndarray, lm_head: np.ndarray) -> ir.Model:
    """heads: per head (A, B [D, D], b [D], C [D, D]); vocab int64 [V']; embed, lm_head [V, D] float32."""
    hidden = embed.shape[1]
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 17, MS_DOMAIN: 1}, name="medusa_draft")
    model = ir.Model(graph, ir_version=8)
    state = ir.Value(name=medusa.DRAFT_HIDDEN, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", hidden]))
    token = ir.Value(name=medusa.DRAFT_TOKEN, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch"]))
    graph.inputs.extend([state, token])

    index = np.full(embed.shape[0], len(vocab), np.int64)
    index[vocab] = np.arange(len(vocab))
    table = np.concatenate([embed[vocab], np.zeros((1, hidden), np.float32)]).astype(np.float32)
    idx = _add(graph, "Gather", [initializer(model, "draft.index", index), token])
    vocab_ids = initializer(model, "draft.vocab", vocab.astype(np.int64))
    head_table = _quantized(lm_head[vocab])
    axis1 = initializer(model, "draft.axis1", np.array([1], np.int64))
    guesses, confidences = [], []
    first_head: ir.Node | None = None
    for i, (a, b, bias, c) in enumerate(heads):
        token_term = initializer(model, f"draft.{i}.token_term", (table @ b.T + bias).astype(np.float16))
        from_token = _add(graph, "Cast", [_add(graph, "Gather", [token_term, idx])], {"to": ir.DataType.FLOAT})
        from_state = make_matmul_nbits(model, state, _quantized(a), f"draft.{i}.state")
        graph.append(from_state)
        pre = _add(graph, "Add", [from_state.outputs[0], from_token])
        silu = _add(graph, "Mul", [pre, _add(graph, "Sigmoid", [pre])])
        out = make_matmul_nbits(model, silu, _quantized(c), f"draft.{i}.out")
        graph.append(out)
        state = _add(graph, "Add", [state, out.outputs[0]])
        if first_head is None:
            first_head = make_matmul_nbits(model, state, head_table, "draft.lm_head")
            graph.append(first_head)
            logits = first_head.outputs[0]
        else:  # the same weight tensors as the first head's
            logits = _add(graph, "MatMulNBits", [state, *first_head.inputs[1:4]],
                          {attr.name: attr.value for attr in first_head.attributes.values()}, MS_DOMAIN)
        idx = _add(graph, "ArgMax", [logits], {"axis": 1, "keepdims": 0})
        guesses.append(_add(graph, "Unsqueeze", [_add(graph, "Gather", [vocab_ids, idx]), axis1]))
        confidences.append(_top_probability(graph, logits, axis1))
    for values, name, dtype in ((guesses, medusa.DRAFT_TOKENS, ir.DataType.INT64),
                                (confidences, medusa.DRAFT_CONFIDENCE, ir.DataType.FLOAT)):
        out = _add(graph, "Concat", values, {"axis": 1})
        out.name, out.type, out.shape = name, ir.TensorType(dtype), ir.Shape(["batch", len(heads)])
        graph.outputs.append(out)
    return model


def _top_probability(graph: ir.Graph, logits: ir.Value, axis1: ir.Value) -> ir.Value:
    """[B, 1]: the softmax probability of the top logit, 1 / sum(exp(logits - max)) (axis1: the int64 [1])."""
    top = _add(graph, "ReduceMax", [logits], {"axes": [1], "keepdims": 1})  # opset 17: axes an attribute here,
    shifted = _add(graph, "Exp", [_add(graph, "Sub", [logits, top])])
    mass = _add(graph, "ReduceSum", [shifted, axis1], {"keepdims": 1})  # an input here
    return _add(graph, "Reciprocal", [mass])


def save_draft_graph(model: ir.Model, engine_dir: Path) -> Path:
    path = Path(engine_dir) / medusa.DRAFT_FILE
    ir.save(model, path)
    return path


def _quantized(w: np.ndarray) -> GroupQuantized:
    return quantize_groupwise(w, WEIGHT_BITS, WEIGHT_GROUP)


def _add(graph: ir.Graph, op: str, inputs: list, attributes: dict | None = None, domain: str = "") -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes or {}, domain=domain)
    graph.append(node)
    return node.outputs[0]
