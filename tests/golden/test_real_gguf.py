"""Golden: GGUF files as llama.cpp's own tools write them (tests/data/gguf, made by make_fixtures.py with
convert_hf_to_gguf.py and llama-quantize; fixtures.json names the llama.cpp commit), read by kiln and built into
fp32 engines whose logits equal an independent reference on packed ragged steps (chunked prefill and decodes):

- transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``, dequantized by gguf-py) for the
  architectures it reads, so the file's numbers (f16, Q8_0, Q4_K_M's mix) are the reference's numbers too;
- the Hugging Face model the fixture was converted from, regenerated from its family, overrides and seed
  (tests/helpers.py), for f32 files: the converter's round trip is exact, so the logits must be too.

The engine's tokenizer (prompts are encoded with it) and chat template are the file's. Quantized fixtures are also
built with ``--quantization gguf`` (the file's own blocks, kiln.MatMulGGUF) and held to the dequantized engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine_numerics import generate_chunked

pytest.importorskip("gguf")

DATA = Path(__file__).resolve().parent.parent / "data" / "gguf"
INDEX = json.loads((DATA / "fixtures.json").read_text())
FIXTURES = INDEX["fixtures"]
# Families whose GGUF files transformers' GGUF loader reads into the same model (given _config_as_the_file). It does
# not read OLMoE or Mixtral's llama-with-experts, drops Phi-3's LongRoPE factors and partial rotary, and sizes
# Qwen-MoE experts by the dense feed_forward_length: those fixtures are f32, held to their source model.
TRANSFORMERS_READS = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"}
STEPS = 4


def lengths(name: str) -> list[int]:
    """Prompt lengths; LongRoPE models' sequences all run past the original context (32), where transformers uses
    the long factors on every position (the engine's context is the model's 128: long factors throughout)."""
    return [33, 40, 47, 60] if FIXTURES[name]["family"].startswith("phi") else [3, 7, 20, 33]


def references(name: str) -> list[str]:
    fixture = FIXTURES[name]
    refs = ["transformers-gguf"] if fixture["family"] in TRANSFORMERS_READS else []
    if fixture["outtype"] == "f32" and fixture["quantized"] is None:
        refs.append("hf-source")
    return refs


CASES = [(name, ref) for name in FIXTURES for ref in references(name)]


def test_every_fixture_has_a_reference_and_its_recorded_bytes():
    import hashlib

    assert INDEX["llama_cpp"] and INDEX["made_by"] == "tests/data/gguf/make_fixtures.py"
    for name, fixture in FIXTURES.items():
        assert references(name), f"{name} has no reference"
        data = (DATA / f"{name}.gguf").read_bytes()
        assert hashlib.sha256(data).hexdigest() == fixture["sha256"], f"{name}.gguf is not the file fixtures.json lists"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> engine dir (fp32 weights, float32 KV), built once per fixture on first use."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    root = tmp_path_factory.mktemp("real-gguf")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = root / name
            build_engine(DATA / f"{name}.gguf", built[name], BuildOptions(kv_dtype="float32"),
                         progress=lambda _msg: None)
        return built[name]

    return get


def _config_as_the_file(config, path: Path) -> None:
    """What transformers' GGUF config mapping leaves out, taken from the file: head_dim from key_length (Qwen3's
    is not hidden / heads), the vocabulary from token_embd's rows (the converter trims it to the tokenizer's), no
    pad id (Phi-3's default 32000 lies outside a tiny vocabulary), and Gemma's attention scale as llama.cpp takes
    it, 1/sqrt(head_dim) (transformers keeps its config default query_pre_attn_scalar 256)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config.vocab_size = int(embd.shape[1])
    config.pad_token_id = None
    if arch.startswith("gemma"):
        config.query_pre_attn_scalar = config.head_dim


def reference_model(name: str, kind: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    if kind == "transformers-gguf":  # from_pretrained(gguf_file=) without accelerate: its config, mapping, tensors
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        path = DATA / f"{name}.gguf"
        config = AutoConfig.from_pretrained(DATA, gguf_file=path.name)
        _config_as_the_file(config, path)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
        model.tie_weights()
        return model
    from helpers import make_tiny_hf_model

    fixture = FIXTURES[name]
    source = make_tiny_hf_model(tmp_path, fixture["family"], seed=fixture["seed"], **fixture["overrides"])
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()


def max_error(engine: Path, model, prompt_lengths: list[int]) -> tuple[float, float]:
    """(max |engine - reference| over every step's rows, max |reference|); greedy tokens checked equal."""
    seqs, rows = generate_chunked(engine, prompt_lengths, STEPS)
    worst = size = 0.0
    for s, (seq, prompt_len) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        tokens = seq[: prompt_len + STEPS]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None]).logits[0]
        positions = [pos for pos, _ in rows[s]]
        got = np.stack([row for _, row in rows[s]])
        vocab = got.shape[-1]  # the converter trims token_embd to the tokenizer's vocabulary (gemma3)
        want = ref.numpy()[positions]
        assert np.abs(want[:, vocab:]).max(initial=0.0) == 0.0 or model.config.vocab_size > vocab
        worst = max(worst, float(np.abs(got - want[:, :vocab]).max()))
        size = max(size, float(np.abs(want).max()))
        decoded = [i for i, pos in enumerate(positions) if pos >= prompt_len - 1]
        assert [seq[positions[i] + 1] for i in decoded] == want[decoded, :vocab].argmax(-1).tolist(), f"greedy {s}"
    return worst, size


@pytest.mark.parametrize("name, kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_real_gguf_engine_matches_reference(engines, tmp_path, name, kind):
    err, size = max_error(engines(name), reference_model(name, kind, tmp_path), lengths(name))
    assert size > 1  # logits of some size: the bound means something
    assert err <= 1e-4 * max(1.0, size), f"{name}: max |logits - {kind}| = {err:.2e}"


QUANTIZED = [name for name, fixture in FIXTURES.items() if fixture["quantized"]]


def file_types(name: str) -> dict[str, str]:
    """GGUF tensor name -> its ggml type name, as llama-quantize chose it."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(DATA / f"{name}.gguf")).tensors}


@pytest.mark.parametrize("scheme", ["gguf-exact", "gguf"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantization_gguf_executes_the_files_own_blocks(engines, tmp_path, name, scheme):
    """--quantization gguf-exact / gguf: every linear on kiln.MatMulGGUF in the types llama-quantize chose (Q4_K_M's
    Q4_K / Q6_K, its Q5_0 / Q8_0 fallbacks where K is no multiple of 256, Q4_0), but gguf's Q4_0 linears, which run on
    kiln.MatMulQ4_1 (the same weights as Q4_1 codes). gguf-exact (float32 activations): logits within 1e-3 of the
    dequantized engine's where the embedding table is kept exactly too (Q8_0, Q6_K). gguf: int8 activations on every
    type with an int8 kernel (Q5_0 keeps float32), logits within int8 rounding."""
    import onnx

    from kiln.contract import CENTRE_ABI
    from kiln.gguf_blocks import GgmlType
    from kiln.gguf_int8 import INT8_KINDS
    from kiln.manifest import BuildOptions, read_manifest
    from kiln.matmul_q4_1 import Q4_0_CENTRE, node_centre
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import QuantScheme

    engine = tmp_path / "gguf"
    options = BuildOptions(quantization=QuantScheme.parse(scheme), kv_dtype="float32")
    build_engine(DATA / f"{name}.gguf", engine, options, progress=lambda _msg: None)
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    assert not [n for n in graph.graph.node if n.op_type in ("MatMul", "MatMulNBits")]
    q4_0_as_q4_1 = scheme == "gguf" and "Q4_0" in file_types(name).values()
    q4_1_nodes = [n for n in graph.graph.node if n.op_type == "MatMulQ4_1"]
    assert bool(q4_1_nodes) == q4_0_as_q4_1
    assert all(node_centre(n) == Q4_0_CENTRE for n in q4_1_nodes)  # Q4_0's own sums: d * xs * ((q - 8) . xq)
    assert (read_manifest(engine).op_library_abi == CENTRE_ABI) == q4_0_as_q4_1
    nodes = [{a.name: a.i for a in n.attribute} for n in graph.graph.node if n.op_type == "MatMulGGUF"]
    kept = {GgmlType(n["ggml_type"]).name for n in nodes}
    for n in nodes:
        int8 = scheme == "gguf" and GgmlType(n["ggml_type"]) in INT8_KINDS
        assert n.get("int8_activations", 0) == int(int8), n
    matrices = {kind for tensor, kind in file_types(name).items() if kind != "F32" and tensor != "token_embd.weight"}
    tied = "output.weight" not in file_types(name)
    assert kept == (matrices | ({file_types(name)["token_embd.weight"]} if tied else set())) - (
        {"Q4_0"} if q4_0_as_q4_1 else set())
    exact, kept_logits = fixed_rows(engines(name)), fixed_rows(engine)
    assert np.abs(exact).max() > 1
    if scheme == "gguf":  # activations rounded to int8 blocks: llama.cpp's arithmetic, not the float one
        assert np.abs(kept_logits - exact).max() < 5e-2 * np.abs(exact).max()
    elif file_types(name)["token_embd.weight"] in ("Q8_0", "Q6_K"):  # tables kept as the file's numbers
        assert np.abs(kept_logits - exact).max() < 1e-3
    else:  # a Q4_K table (untied Q4_K_M files) takes 8-bit blocks of 32: its float minimums have no integer zero point
        assert np.abs(kept_logits - exact).max() < 2e-2 * np.abs(exact).max()


def fixed_rows(engine: Path) -> np.ndarray:
    """Logits of every row of a fixed schedule (a prompt in two chunks, then three decodes of fixed tokens): two
    engines compared on the same tokens, whatever each would pick."""
    from engine_driver import PagedDriver
    from test_engine_numerics import prompts

    prompt = prompts(engine, [40])[0]
    driver = PagedDriver(engine / "model.onnx", threads=2, num_blocks=16)
    rows = [driver.step([(0, prompt[:25])], all_rows=True), driver.step([(0, prompt[25:])], all_rows=True)]
    rows += [driver.step([(0, [token])]) for token in prompt[:3]]
    return np.concatenate(rows)


def test_kiln_build_of_a_quantize_output_carries_its_tokenizer_and_generates(tmp_path):
    """`kiln build X.gguf` (the defaults: the file's own blocks with int8 activations, float16 KV) of llama-quantize's
    output: the engine's tokenizer and chat template are the file's, chat renders and generates, and its logits stay
    within that rounding of the dequantized reference."""
    from click.testing import CliRunner
    from gguf import GGUFReader

    from kiln.cli import main
    from kiln.runtime import LLM, SamplingParams

    name = "llama256-q4_k_m"
    engine = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(DATA / f"{name}.gguf"), "-o", str(engine)])
    assert result.exit_code == 0, result.output
    fields = GGUFReader(str(DATA / f"{name}.gguf")).fields
    config = json.loads((engine / "tokenizer_config.json").read_text())
    assert config["chat_template"] == fields["tokenizer.chat_template"].contents()
    llm = LLM(engine)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "the weather"}])
    assert prompt.startswith("<|im_start|>user\nthe weather<|im_end|>\n<|im_start|>assistant\n")
    out = llm.chat([{"role": "user", "content": "the weather"}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text
    err, size = max_error(engine, reference_model(name, "transformers-gguf", tmp_path), [3, 7, 20, 33])
    assert err <= 2e-2 * size, f"max |logits - transformers-gguf| = {err:.2e} of {size:.1f}"
