"""Golden: the mixture-of-experts families (kiln.MoE) built into engines, against transformers.

Each tiny random model (tests/helpers.py: the real configs' routing, shrunk) is built in fp32 and decoded on packed
ragged steps (prefill chunks mixed with decodes); every logits row must equal transformers' within 1e-4 and greedy
tokens must agree. The same engine with its routing perturbed (top_k off by one, the renormalisation flag flipped,
the experts' order reversed against the router's) must fail that comparison: the check sees the routing.
"""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from gguf import GGUFReader
from test_engine_numerics import SHORT_PROMPTS, check_against_transformers

from kiln.contract import MOE_RECORDS_ABI, QK_NORM_ABI
from kiln.gguf_blocks import GgmlType, random_blocks
from kiln.moe import OP_TYPE
from kiln.moe_gguf import experts_from_records

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]


def moe_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == OP_TYPE and node.domain == "kiln"]


def edited_copy(engine: Path, out: Path, edit: Callable[[onnx.ModelProto], None]) -> Path:
    """A copy of the engine's graph (with its weights: the tiny models are small) after `edit` changed it."""
    out.mkdir(parents=True)
    shutil.copy(engine / "tokenizer.json", out / "tokenizer.json")
    model = onnx.load(str(engine / "model.onnx"))
    edit(model)
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


def perturbed_copy(engine: Path, out: Path, how: str) -> Path:
    """A copy of the engine's graph with every kiln.MoE's routing perturbed `how`."""

    def perturb(model: onnx.ModelProto) -> None:
        initializers = {init.name: init for init in model.graph.initializer}
        for node in moe_nodes(model):
            attrs = {a.name: a for a in node.attribute}
            if how == "top_k+1":
                attrs["top_k"].i += 1
            elif how == "top_k-1":
                attrs["top_k"].i -= 1
            elif how == "renormalisation":
                attrs["norm_topk_prob"].i = 1 - attrs["norm_topk_prob"].i
            else:  # expert order: the stacked experts reversed, the router's rows not
                for name in node.input[2:4]:
                    init = initializers[name]
                    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init)[::-1].copy(), name))

    return edited_copy(engine, out, perturb)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_matches_transformers_and_sees_its_routing(tmp_path, family):
    """The family's tiny model built in fp32 equals transformers; each perturbed routing does not."""
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions, read_manifest
    from kiln.optimize.build import build_engine

    model = make_tiny_hf_model(tmp_path, family=family)
    engine = tmp_path / "engine"
    build_engine(model, engine, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    # no kiln.MoE records: older kilns load it, unless kiln.PagedAttention normalises q and k (Qwen3-MoE, OLMoE)
    qk_norms = family in ("qwen3_moe", "olmoe")
    assert read_manifest(engine).op_library_abi == (QK_NORM_ABI if qk_norms else MOE_RECORDS_ABI - 1)
    # one per layer, each reading its own layer's router: the experts' loop traced into the op
    assert [node.input[1] for node in moe_nodes(graph)] == [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    check_against_transformers(engine, model, SHORT_PROMPTS, steps=6, atol=1e-4)

    top_k = next(a.i for a in moe_nodes(graph)[0].attribute if a.name == "top_k")
    for how in ("top_k+1", "top_k-1" if top_k > 1 else None, "renormalisation", "expert order"):
        if how is None:
            continue
        wrong = perturbed_copy(engine, tmp_path / how.replace(" ", "_"), how)
        with pytest.raises(AssertionError):
            check_against_transformers(wrong, model, SHORT_PROMPTS, steps=2, atol=1e-4)


def test_q4_1_moe_engine_holds_records_and_computes_the_blocks_logits(tmp_path):
    """`--quantization int4-q4_1` stores kiln.MoE's Q4_1 experts as the kernel's records (as kiln.MatMulQ4_1's), on
    page boundaries, and the engine computes bit for bit the logits of its copy in blocks (what engines held before
    records, packed at load); it records the op-library ABI that added them."""
    from helpers import make_tiny_hf_model
    from q4_1_records_helpers import assert_records_compute_the_blocks_logits, q4_1_moe_nodes

    from kiln.manifest import BuildOptions, read_manifest
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import QuantScheme

    model = make_tiny_hf_model(tmp_path, family="mixtral")  # no q/k norms, which need a newer ABI
    engine = tmp_path / "engine"
    build_engine(model, engine, BuildOptions(kv_dtype="float32", quantization=QuantScheme.parse("int4-q4_1")),
                 progress=lambda _msg: None)
    assert len(q4_1_moe_nodes(onnx.load(str(engine / "model.onnx"), load_external_data=False).graph)) == 2
    assert read_manifest(engine).op_library_abi == MOE_RECORDS_ABI
    assert_records_compute_the_blocks_logits(engine, tmp_path)


@pytest.mark.parametrize("shape", [{}, {"hidden_size": 256, "intermediate_size": 256}], ids=["blocks", "records"])
def test_int8_weight_only_moe_engine_serves_q8_0_experts(tmp_path, shape):
    """`--quantization int8-weight-only` gives every kiln.MoE the Q8_0 of the fp32 build's experts (gguf-py's
    quantizer, bit for bit, expert by expert) as GGUF experts with int8 activations, as the dense linears' int8
    weights take theirs, held as Q8_0 records where D and F are whole superblocks of 256; the engine stays within
    int8's error of transformers (0.07 measured, the dense int8 linears' share) with equal greedy tokens."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions
    from kiln.matmul_gguf import INT8_ATTRIBUTE
    from kiln.moe_gguf import TYPE_ATTRIBUTES
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import QuantScheme

    model = make_tiny_hf_model(tmp_path, family="olmoe", **shape)
    graphs = {}
    for scheme in ("none", "int8-weight-only"):
        engine = tmp_path / scheme
        build_engine(model, engine, BuildOptions(kv_dtype="float32", quantization=QuantScheme.parse(scheme)),
                     progress=lambda _msg: None)
        graphs[scheme] = onnx.load(str(engine / "model.onnx"))
    for float_node, node in zip(*(moe_nodes(g) for g in graphs.values()), strict=True):
        attributes = {a.name: a.i for a in node.attribute}
        assert [attributes[name] for name in TYPE_ATTRIBUTES] == [GgmlType.Q8_0] * 3
        assert attributes[INT8_ATTRIBUTE] == 1
        records = next((a.s.decode() for a in node.attribute if a.name == "layout"), "blocks") == "records"
        assert records == bool(shape)
        floats, q8 = ({init.name: init for init in g.graph.initializer} for g in graphs.values())
        held = [onnx.numpy_helper.to_array(q8[node.input[i]]) for i in (2, 3)]
        if records:
            held = list(experts_from_records(*held, (GgmlType.Q8_0,) * 3))
        for i, blocks in zip((2, 3), held, strict=True):  # gate_up, then down
            stack = onnx.numpy_helper.to_array(floats[float_node.input[i]])
            assert blocks.shape[:2] == stack.shape[:2]
            for e in range(stack.shape[0]):
                np.testing.assert_array_equal(blocks[e], quantize(stack[e], GGMLQuantizationType.Q8_0))
    check_against_transformers(tmp_path / "int8-weight-only", model, SHORT_PROMPTS, steps=4, atol=0.15)


def test_moe_spec_rejects_partly_dense_configs(tmp_path):
    """Qwen-MoE configs with dense layers among the sparse ones are refused by name, not compiled wrong."""
    from kiln.spec import ModelSpec

    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "moe_intermediate_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "mlp_only_layers": [1]}
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(config)
    spec = ModelSpec.from_hf_config({**config, "mlp_only_layers": []})
    assert (spec.num_experts, spec.experts_per_token, spec.intermediate_size) == (4, 2, 4)


def test_mixtral_gguf_engine_matches_transformers(tmp_path):
    """llama.cpp's layout of Mixtral (general.architecture llama, stacked ffn_*_exps, permuted q/k rows) builds
    into the engine the Hugging Face checkpoint gives."""
    from tiny_gguf import make_tiny_gguf

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, "mixtral")
    build_engine(gguf_path, tmp_path / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    check_against_transformers(tmp_path / "engine", hf_dir, SHORT_PROMPTS, steps=4, atol=1e-4)


# A Q4_K_M-like MoE file: the experts' gate/up Q4_K, down Q6_K in layer 0 and Q4_K in layer 1 (llama.cpp's "more
# bits" layers), attention Q4_K with a Q8_0 output projection (its 128 inputs are no k-quant block), a Q6_K head
# and a Q8_0 table; the routers float32, as llama.cpp's quantizer leaves them.
K_QUANT_MOE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2)
K_QUANT_TYPES = {"ffn_down_exps": {0: GgmlType.Q6_K, 1: GgmlType.Q4_K}, "attn_output": GgmlType.Q8_0,
                 "output": GgmlType.Q6_K, "token_embd": GgmlType.Q8_0}


def _k_quant_blocks(name: str, array: np.ndarray):
    """(type, random blocks) for every matrix and expert stack but the routers (kept float32)."""
    if ".ffn_gate_inp" in name:
        return None
    parts = name.split(".")
    base = parts[-2]
    kind = K_QUANT_TYPES.get(base, GgmlType.Q4_K)
    if isinstance(kind, dict):
        kind = kind[int(parts[1])]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    std = 0.5 if base == "token_embd" else 1 / np.sqrt(array.shape[-1])
    rows = int(np.prod(array.shape[:-1]))
    return kind, random_blocks(rng, kind, rows, array.shape[-1], std).reshape(*array.shape[:-1], -1)


def _logits(model, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None]).logits[0].numpy()


def _steps(engine: Path, steps: int):
    """Per prompt of SHORT_PROMPTS, greedy on packed ragged steps (test_engine_numerics.generate_chunked): (the
    tokens (those fed, then the last chosen), the positions that got logits, those logits, the positions whose
    logits chose the token after)."""
    from test_engine_numerics import generate_chunked

    seqs, rows = generate_chunked(engine, SHORT_PROMPTS, steps)
    for seq, prompt_len, seq_rows in zip(seqs, SHORT_PROMPTS, rows, strict=True):
        positions = [pos for pos, _ in seq_rows]
        yield (seq, positions, np.stack([row for _, row in seq_rows]),
               [pos for pos in positions if pos >= prompt_len - 1])


def _rerounded_experts(model):
    """transformers' model with its experts re-rounded to Q4_1 (what int4-q4_1 would serve of the file's experts)."""
    import torch

    from kiln.optimize.quant.rtn import quantize_q4_1

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                w = param.detach().numpy().reshape(-1, param.shape[-1])
                param.copy_(torch.from_numpy(quantize_q4_1(np.ascontiguousarray(w)).dequantize().reshape(param.shape)))
    return model


def _float_activations(model: onnx.ModelProto) -> None:
    """Every kiln.MoE and kiln.MatMulGGUF on float32 activations (int8_activations = 0): the same blocks computed as
    `gguf-exact` computes them (kiln.MatMulGGUF's records, an int8-path layout, back in the file's blocks)."""
    from kiln.gguf_records import LAYOUT, unpack_records

    initializers = {init.name: init for init in model.graph.initializer}

    def replace(name: str, array: np.ndarray) -> None:
        initializers[name].CopyFrom(onnx.numpy_helper.from_array(array, name))

    def read(name: str) -> np.ndarray:
        return onnx.numpy_helper.to_array(initializers[name])

    flipped = 0
    for node in model.graph.node:
        attributes = {a.name: a for a in node.attribute}
        if node.domain == "kiln" and LAYOUT in attributes and node.op_type == "MatMulGGUF":
            replace(node.input[1], unpack_records(read(node.input[1]), attributes["ggml_type"].i))
            node.attribute.remove(attributes[LAYOUT])
        if node.domain == "kiln" and LAYOUT in attributes and node.op_type == "MoE" and "gate_type" in attributes:
            types = tuple(attributes[name].i for name in ("gate_type", "up_type", "down_type"))
            gate_up, down = experts_from_records(read(node.input[2]), read(node.input[3]), types)
            replace(node.input[2], gate_up)
            replace(node.input[3], down)
            node.attribute.remove(attributes[LAYOUT])
        if node.domain == "kiln" and "int8_activations" in attributes:
            attributes["int8_activations"].i, flipped = 0, flipped + 1
    assert flipped > len(moe_nodes(model))


def test_k_quant_moe_gguf_engine_serves_the_files_expert_blocks(tmp_path):
    """`kiln build FILE.gguf` (the default `gguf` scheme) keeps a k-quant MoE file's expert blocks as they are:
    kiln.MoE's GGUF experts with the file's bytes and types, each layer's own (in kiln.MatMulGGUF's records).
    Against transformers on the file's dequantized weights the engine differs by its int8 activations alone (every
    linear's and expert's: ~1% of the logits' size on average, what the dense `gguf` engines differ by too), less than
    the file's experts
    re-rounded to Q4_1 differ even with float32 activations, and greedy tokens agree wherever transformers' top two
    logits are further apart than that error; a misplaced block, type or expert would be off by the logits' size.
    The same engine on float32 activations (what `gguf-exact` builds) gives transformers' logits within 1e-3 and its
    greedy tokens."""
    from helpers import load_hf_reference
    from tiny_gguf import make_tiny_gguf

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine
    from kiln.optimize.quantize_gguf import default_quantization
    from kiln.quant_scheme import QuantScheme

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, "qwen3_moe", quantize=_k_quant_blocks, file_weights_in_hf=True,
                                       **K_QUANT_MOE)
    scheme = default_quantization(str(gguf_path))
    assert scheme == "gguf"
    engine = tmp_path / "engine"
    build_engine(gguf_path, engine, BuildOptions(quantization=QuantScheme.parse(scheme), kv_dtype="float32"),
                 progress=lambda _msg: None)
    graph = onnx.load(str(engine / "model.onnx"))
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    for layer, node in enumerate(moe_nodes(graph)):
        attrs = {a.name: a.i for a in node.attribute}
        down = int(K_QUANT_TYPES["ffn_down_exps"][layer])
        assert (attrs["gate_type"], attrs["up_type"], attrs["down_type"]) == (GgmlType.Q4_K, GgmlType.Q4_K, down)
        inits = {init.name: onnx.numpy_helper.to_array(init) for init in graph.graph.initializer
                 if init.name in node.input[2:4]}
        assert {a.name: a.s for a in node.attribute}.get("layout") == b"records"  # Q4_K / Q6_K: the kernel's layout
        gate_up_blocks, down_blocks = experts_from_records(inits[node.input[2]], inits[node.input[3]],
                                                           (GgmlType.Q4_K, GgmlType.Q4_K, down))
        file_bytes = {p: np.asarray(tensors[f"blk.{layer}.ffn_{p}_exps.weight"].data) for p in ("gate", "up", "down")}
        np.testing.assert_array_equal(gate_up_blocks, np.concatenate([file_bytes["gate"], file_bytes["up"]], 1))
        np.testing.assert_array_equal(down_blocks, file_bytes["down"])

    file_model, rerounded = load_hf_reference(hf_dir), _rerounded_experts(load_hf_reference(hf_dir))
    errors, rerounding, decodes = [], [], []
    for tokens, positions, got, decoded in _steps(engine, 4):
        ref = _logits(file_model, tokens[:-1])
        errors.append(np.abs(got - ref[positions]))
        rerounding.append(np.abs(_logits(rerounded, tokens[:-1]) - ref)[positions])
        decodes += [(tokens[pos + 1], ref[pos]) for pos in decoded]
    err, worse = np.concatenate(errors), np.concatenate(rerounding)
    # int8 rounding on this random 2-layer model: ~1% of the logits' size on average, up to ~5% at its worst position
    # (a misplaced block or expert is off by the logits' size)
    assert err.max() < 0.1 * np.abs(np.concatenate([ref for _, ref in decodes])).max()
    assert err.mean() < 0.7 * worse.mean()
    clear = [(token, ref) for token, ref in decodes if np.diff(np.sort(ref)[-2:])[0] > 2 * err.max()]
    assert len(clear) >= len(decodes) // 3  # enough decodes past twice the worst error for the check to mean much
    assert [token for token, _ in clear] == [int(ref.argmax()) for _, ref in clear]

    for tokens, positions, got, decoded in _steps(edited_copy(engine, tmp_path / "float", _float_activations), 3):
        ref = _logits(file_model, tokens[:-1])
        assert np.abs(got - ref[positions]).max() < 1e-3
        assert [tokens[pos + 1] for pos in decoded] == ref[decoded].argmax(-1).tolist()


def _q4_0_experts(name: str, array: np.ndarray):
    """_k_quant_blocks with every expert stack Q4_0 (llama-quantize's Q4_0 files)."""
    if "_exps" not in name:
        return _k_quant_blocks(name, array)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rows = int(np.prod(array.shape[:-1]))
    blocks = random_blocks(rng, GgmlType.Q4_0, rows, array.shape[-1], 1 / np.sqrt(array.shape[-1]))
    return GgmlType.Q4_0, blocks.reshape(*array.shape[:-1], -1)


def test_q4_0_moe_gguf_engine_serves_them_as_q4_1_experts(tmp_path):
    """A MoE file's Q4_0 experts under `gguf` become kiln.MoE's Q4_1 experts (w = d (q - 8): minimum -8 d, the same
    weights), in records; against transformers on the file's dequantized weights the engine differs by its int8
    activations alone (a misplaced block or expert would be off by the logits' size), and greedy tokens agree where
    the top two logits are further apart than twice that."""
    from helpers import load_hf_reference
    from tiny_gguf import make_tiny_gguf

    from kiln.contract import CENTRE_ABI
    from kiln.manifest import BuildOptions, read_manifest
    from kiln.matmul_q4_1 import Q4_0_CENTRE, node_centre
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import QuantScheme

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, "qwen3_moe", quantize=_q4_0_experts, file_weights_in_hf=True,
                                       **K_QUANT_MOE)
    engine = tmp_path / "engine"
    build_engine(gguf_path, engine, BuildOptions(quantization=QuantScheme.parse("gguf"), kv_dtype="float32"),
                 progress=lambda _msg: None)
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    for node in moe_nodes(graph):
        attributes = {a.name for a in node.attribute}
        assert len(node.input) == 6 and "gate_type" not in attributes  # Q4_1 experts, not GGUF ones
        assert {a.name: a.s for a in node.attribute}.get("layout") == b"records"
        assert node_centre(node) == Q4_0_CENTRE  # Q4_0's own sums: d * xs * ((q - 8) . xq)
    assert read_manifest(engine).op_library_abi == CENTRE_ABI
    file_model = load_hf_reference(hf_dir)
    errors, decodes = [], []
    for tokens, positions, got, decoded in _steps(engine, 4):
        ref = _logits(file_model, tokens[:-1])
        errors.append(np.abs(got - ref[positions]))
        decodes += [(tokens[pos + 1], ref[pos]) for pos in decoded]
    err = np.concatenate(errors)
    assert err.max() < 0.1 * np.abs(np.concatenate([ref for _, ref in decodes])).max()
    clear = [(token, ref) for token, ref in decodes if np.diff(np.sort(ref)[-2:])[0] > 2 * err.max()]
    assert len(clear) >= len(decodes) // 3  # enough decodes past twice the worst error for the check to mean much
    assert [token for token, _ in clear] == [int(ref.argmax()) for _, ref in clear]


def test_awq_moe_engine_folds_the_experts_scales(tmp_path):
    """`kiln calibrate --method awq` on a MoE model whose MLP input has two 40x channels, then `--quantization
    int4-awq-g32`: the engine's logits are closer to the fp32 engine's (mean KL on held-out tokens) than with the
    artifact's expert scales removed, which are closer than int4-rtn-g32's; so the experts' scales (the shared input
    scale and each expert's down scales) reach the Q4_1 experts, and help."""
    import torch
    from engine_driver import PagedDriver
    from helpers import make_tiny_hf_model
    from safetensors.torch import load_file, save_file

    from kiln.calibration.artifact import CalibrationArtifact
    from kiln.calibration.calibrate import CalibrationConfig, calibrate
    from kiln.export.checkpoint import load_checkpoint
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import QuantScheme

    model = make_tiny_hf_model(tmp_path, family="olmoe")
    weights = load_file(model / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("post_attention_layernorm.weight"):
            w[[3, 17]] *= 40.0
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(3, 320, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    artifact = calibrate(load_checkpoint(model), ids, CalibrationConfig("awq", num_windows=8, window=128,
                                                                        rows_per_window=64, group_size=32))
    dense_only = CalibrationArtifact(artifact.method, artifact.model_fingerprint, artifact.hyperparameters,
                                     {k: v for k, v in artifact.scales.items() if ".mlp." not in k}, artifact.info)
    prompt = torch.randint(3, 320, (60,), generator=torch.Generator().manual_seed(7)).tolist()

    def logits(scheme: str, calibration: CalibrationArtifact | None = None) -> torch.Tensor:
        name = f"{scheme}-{'none' if calibration is None else len(calibration.scales)}"
        engine = tmp_path / name
        options = BuildOptions(kv_dtype="float32", quantization=QuantScheme.parse(scheme),
                               calibration=None if calibration is None else calibration.save(tmp_path / f"{name}.awq"))
        build_engine(model, engine, options, progress=lambda _msg: None)
        driver = PagedDriver(engine / "model.onnx", threads=1, num_blocks=16)
        rows = [driver.step([(0, prompt[:30])], all_rows=True), driver.step([(0, prompt[30:])], all_rows=True)]
        return torch.log_softmax(torch.tensor(np.concatenate(rows)), -1)

    reference = logits("none")

    def kl(scheme: str, calibration: CalibrationArtifact | None = None) -> float:
        return float((reference.exp() * (reference - logits(scheme, calibration))).sum(-1).mean())

    with_experts, without, rtn = kl("int4-awq-g32", artifact), kl("int4-awq-g32", dense_only), kl("int4-rtn-g32")
    assert with_experts < 0.95 * without and without < rtn, (with_experts, without, rtn)
