"""Medusa heads compiled into the tiny engine: the graph's medusa_logits match the torch heads, the
logits are unchanged, the quantization passes keep working with the heads present, and the
build refuses heads trained for another model. Hydra heads: the graph returns the final norm's output
instead, the engine carries their draft graph, and speculation with them keeps greedy output exact."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from engine_driver import PagedDriver
from medusa_fixtures import tiny_text

from kiln import contract
from kiln.manifest import BuildOptions, read_manifest
from kiln.optimize.quantize import quantize_model
from kiln.quant_scheme import QuantScheme

PROMPT = [5, 77, 190, 33, 250, 12, 8, 99, 140, 201, 64, 3, 17, 222, 180, 45, 71, 300, 9, 128] * 2


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory, tiny_model_dir):
    from kiln.export.checkpoint import load_checkpoint
    from kiln.heads.medusa_train import MedusaConfig, train_medusa

    config = MedusaConfig(num_heads=3, text_prompts=8, chat_prompts=8, prompt_tokens=24, new_tokens=16, epochs=2)
    artifact = train_medusa(load_checkpoint(tiny_model_dir), tiny_text(), config)
    with torch.no_grad():  # trained heads on a random model are near zero: make them matter for the comparison
        for name, tensor in artifact.tensors.items():
            tensor.add_(0.3 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(len(name))))
    return artifact.save(tmp_path_factory.mktemp("medusa") / "heads")


@pytest.fixture(scope="module")
def medusa_engine(tmp_path_factory, tiny_model_dir, medusa_dir):
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("medusa-engine") / "engine"
    # float32 KV, as tiny_engine's: held to the torch heads and to the plain engine's logits
    build_engine(tiny_model_dir, out, BuildOptions(kv_dtype="float32", medusa=medusa_dir), progress=lambda _m: None)
    return out


def torch_reference(tiny_model_dir, medusa_dir, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], heads' logits [T, K, V]) of the torch reference model and the torch heads."""
    from kiln.calibration.collect import run_layers
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.reference import ReferenceModel
    from kiln.heads.medusa_data import lm_head_weight
    from kiln.heads.medusa_heads import MedusaArtifact

    model = ReferenceModel.from_checkpoint(load_checkpoint(tiny_model_dir))
    heads = MedusaArtifact.load(medusa_dir).heads()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        x = model.model.norm(run_layers(model, ids, torch.arange(len(tokens))[None]))[0]
        head = lm_head_weight(model)
        return x @ head.T, heads.logits(x, head)


def test_medusa_logits_match_the_torch_heads(medusa_engine, tiny_model_dir, medusa_dir):
    manifest = read_manifest(medusa_engine)
    assert manifest.medusa is not None and manifest.medusa.num_heads == 3
    assert contract.MEDUSA_INDICES in manifest.graph_inputs and contract.MEDUSA_LOGITS in manifest.graph_outputs
    logits_ref, heads_ref = torch_reference(tiny_model_dir, medusa_dir, PROMPT)
    driver = PagedDriver(medusa_engine / "model.onnx", threads=1, num_blocks=16)
    assert driver.runner.num_medusa_heads == 3
    first = driver.step_medusa([(0, PROMPT[:25])], all_rows=True)  # a prefill chunk, then the rest
    rest = driver.step_medusa([(0, PROMPT[25:])], all_rows=True)
    logits = np.concatenate([first.logits, rest.logits])
    heads = np.concatenate([first.medusa_logits, rest.medusa_logits])
    assert heads.shape == (len(PROMPT), 3, logits.shape[-1])
    np.testing.assert_allclose(logits, logits_ref.numpy(), atol=1e-3, rtol=0)
    np.testing.assert_allclose(heads, heads_ref.numpy(), atol=1e-3, rtol=0)
    # the heads differ from the LM head and from each other: a graph that dropped them would fail above
    assert np.abs(heads - logits[:, None]).max() > 0.1


def test_medusa_rows_are_their_own_input(medusa_engine, tiny_model_dir, medusa_dir):
    logits_ref, heads_ref = torch_reference(tiny_model_dir, medusa_dir, PROMPT[:12])
    driver = PagedDriver(medusa_engine / "model.onnx", threads=1, num_blocks=16)
    out = driver.step_medusa([(0, PROMPT[:12])], all_rows=False, medusa_rows=[3, 11, 7])
    np.testing.assert_allclose(out.logits, logits_ref[-1:].numpy(), atol=1e-3, rtol=0)
    np.testing.assert_allclose(out.medusa_logits, heads_ref[[3, 11, 7]].numpy(), atol=1e-3, rtol=0)
    # no Medusa rows: the step is an ordinary one
    none = PagedDriver(medusa_engine / "model.onnx", threads=1, num_blocks=16).step_medusa(
        [(0, PROMPT[:12])], medusa_rows=[])
    assert none.medusa_logits.shape == (0, 3, out.logits.shape[-1])
    np.testing.assert_allclose(none.logits, out.logits, atol=1e-5, rtol=0)


def test_engine_without_heads_is_unchanged(tiny_engine, medusa_engine):
    plain = read_manifest(tiny_engine)
    assert plain.medusa is None and plain.build.medusa is None
    assert contract.MEDUSA_INDICES not in plain.graph_inputs
    driver = PagedDriver(tiny_engine / "model.onnx", threads=1, num_blocks=16)
    assert driver.runner.num_medusa_heads == 0
    out = driver.step_medusa([(0, PROMPT[:12])], medusa_rows=[])
    assert out.medusa_logits is None
    with pytest.raises(ValueError, match="no Medusa heads"):
        driver.step_medusa([(0, PROMPT[12:14])], medusa_rows=[0])
    with_heads = PagedDriver(medusa_engine / "model.onnx", threads=1, num_blocks=16).step([(0, PROMPT[:12])])
    np.testing.assert_allclose(with_heads, out.logits, atol=1e-5, rtol=0)


def quantized(engine, out_dir, scheme: str):
    model = ir.load(engine / "model.onnx")
    count = quantize_model(model, QuantScheme.parse(scheme))
    out_dir.mkdir()
    ir.save(model, out_dir / "model.onnx", external_data="model.onnx.data")
    return out_dir / "model.onnx", count


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("scheme", ["int8-weight-only", "int4-rtn-g32", "int4-q4_1", "w8a8-smoothquant"])
def test_quantized_engine_with_heads(tiny_engine, medusa_engine, tmp_path, scheme):
    """Every weight scheme quantizes the heads' fused linear with the rest; the logits rows are exactly those
    of the same scheme without heads, and the heads' logits stray from fp32 no more than the logits do."""
    path, count = quantized(medusa_engine, tmp_path / "heads", scheme)
    assert count == 2 * 4 + 1 + 1  # per layer fused qkv, o, fused gate/up, down; the LM head; the heads' linear
    plain_path, _ = quantized(tiny_engine, tmp_path / "plain", scheme)
    fp32 = PagedDriver(medusa_engine / "model.onnx", threads=1, num_blocks=16).step_medusa([(0, PROMPT)], True)
    out = PagedDriver(path, threads=1, num_blocks=16).step_medusa([(0, PROMPT)], True)
    plain = PagedDriver(plain_path, threads=1, num_blocks=16).step([(0, PROMPT)], True)
    np.testing.assert_allclose(out.logits, plain, atol=1e-4 * np.abs(plain).max(), rtol=0)
    assert rel_error(out.medusa_logits, fp32.medusa_logits) < 2 * rel_error(out.logits, fp32.logits) + 0.02


def test_build_refuses_heads_of_another_model(tmp_path, medusa_dir):
    from helpers import make_tiny_hf_model

    from kiln.optimize.build import BuildError, build_engine

    other = make_tiny_hf_model(tmp_path / "other", family="llama", seed=7)
    with pytest.raises(BuildError, match="fingerprints differ"):
        build_engine(other, tmp_path / "engine", BuildOptions(medusa=medusa_dir), progress=lambda _m: None)
    with pytest.raises(BuildError, match="not a Medusa heads directory"):
        build_engine(other, tmp_path / "engine", BuildOptions(medusa=tmp_path), progress=lambda _m: None)


def test_build_refuses_medusa_heads_with_a_rescored_lm_head(tmp_path, tiny_model_dir, medusa_dir):
    """Medusa heads read the LM head's rows through a Split the rescoring cannot follow: refused before export."""
    from kiln.optimize.build import BuildError, build_engine
    from kiln.quant_scheme import LmHead, QuantScheme

    options = BuildOptions(quantization=QuantScheme.parse("int4-q4_1"), lm_head=LmHead.INT4_RESCORED, medusa=medusa_dir)
    with pytest.raises(BuildError, match="Medusa heads share the LM head's rows"):
        build_engine(tiny_model_dir, tmp_path / "engine", options, progress=lambda _m: None)
    assert not (tmp_path / "engine").exists()


def test_medusa_speculation_is_token_identical_to_plain_decoding(medusa_engine):
    """The runtime's medusa proposer on the real graph: greedy output as without speculation, over a
    batch of sequences of different lengths (several verified rows each, heads read at every one)."""
    from kiln.runtime import LLM, RuntimeConfig, SamplingParams
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import SpeculativeConfig

    prompts = [PROMPT[:n] for n in (5, 12, 20, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(load_engine(medusa_engine, RuntimeConfig(num_threads=1))).generate(prompts, params)
    spec = SpeculativeConfig("medusa", num_tokens=3, max_batch_tokens=16)
    engine = load_engine(medusa_engine, RuntimeConfig(num_threads=1, speculative=spec))
    got = LLM(engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = engine.stats()
    assert stats.num_spec_verifications > 0 and stats.num_spec_proposed_tokens > 0


def test_medusa_speculation_needs_heads(tiny_engine):
    from kiln.manifest import EngineLoadError
    from kiln.runtime import RuntimeConfig
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import SpeculativeConfig

    with pytest.raises(EngineLoadError, match="needs Medusa heads in the engine"):
        load_engine(tiny_engine, RuntimeConfig(speculative=SpeculativeConfig("medusa")))


def test_train_medusa_chat_end_to_end(tiny_model_dir, tiny_engine):
    """`kiln train-medusa --answers-from`: answers from the runtime, teacher-forced rows, heads, scores."""
    from kiln import corpus
    from kiln.export.checkpoint import load_checkpoint
    from kiln.heads.medusa_train import ChatAnswers, MedusaConfig, train_medusa_chat

    try:
        for source in corpus.SOURCES:
            source.root()
    except corpus.CorpusNotFound as exc:  # make install fetches it
        pytest.skip(str(exc))
    config = MedusaConfig(num_heads=2, new_tokens=6, epochs=1, label_vocabulary=True)
    source = ChatAnswers(str(tiny_engine), prompts=8, threads=1, prompt_source="templates")
    artifact = train_medusa_chat(load_checkpoint(tiny_model_dir), source, config)
    info = artifact.info
    assert info["data"]["train_prompts"] == 7 and info["data"]["heldout_prompts"] == 1
    assert 0 < info["train"]["rows"] <= 7 * 6 and 0 < info["chat"]["rows"] <= 24 * 6  # answers may end early
    assert len(info["chat"]["top1_accuracy"]) == 2


def test_self_instructed_prompts_refuse_a_model_that_writes_no_user_turn(tiny_engine):
    """A random model never closes the user turn it is asked to write: a clear error, not an endless loop
    (what is kept from a chat model: tests/unit/test_medusa.py)."""
    from kiln.heads.medusa_train import ChatAnswers

    with pytest.raises(ValueError, match="wrote only 0 usable user turns in 64 samples.*--prompt-source templates"):
        ChatAnswers(str(tiny_engine), prompts=8, threads=1).chat_prompts(0, lambda _m: None)


@pytest.fixture(scope="module")
def hydra_engine(tmp_path_factory, tiny_model_dir):
    """An engine with random hydra heads (kiln/medusa.py kind "hydra"; training is tests/unit/test_hydra.py's)."""
    from kiln import medusa
    from kiln.export.checkpoint import load_checkpoint
    from kiln.heads.medusa_heads import HydraHeads, MedusaArtifact
    from kiln.optimize.build import build_engine

    checkpoint = load_checkpoint(tiny_model_dir)
    embed = checkpoint.weights["model.embed_tokens.weight"]
    torch.manual_seed(0)
    heads = HydraHeads(3, torch.arange(128), embed, embed)
    with torch.no_grad():
        heads.state_weight.normal_(0, 0.3)
        heads.token_weight.normal_(0, 0.3)
    info = {"format": medusa.ARTIFACT_FORMAT, "kind": "hydra", "num_heads": 3, "hidden_size": embed.shape[1],
            "model_source": checkpoint.source, "model_fingerprint": checkpoint.fingerprint()}
    heads = MedusaArtifact(heads.state(), info).save(tmp_path_factory.mktemp("hydra") / "heads")
    out = tmp_path_factory.mktemp("hydra-engine") / "engine"
    build_engine(tiny_model_dir, out, BuildOptions(kv_dtype="float32", medusa=heads), progress=lambda _m: None)
    return out


def test_hydra_engine_returns_the_final_norms_output(hydra_engine, tiny_model_dir):
    """medusa_hidden is what the LM head reads, at the rows asked for; the logits are those of the plain graph."""
    from kiln.calibration.collect import run_layers
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.reference import ReferenceModel
    from kiln.medusa import DRAFT_FILE

    manifest = read_manifest(hydra_engine)
    assert manifest.medusa is not None and manifest.medusa.kind == "hydra" and manifest.medusa.num_heads == 3
    assert contract.MEDUSA_HIDDEN in manifest.graph_outputs and contract.MEDUSA_LOGITS not in manifest.graph_outputs
    assert (hydra_engine / DRAFT_FILE).is_file()
    model = ReferenceModel.from_checkpoint(load_checkpoint(tiny_model_dir))
    with torch.no_grad():
        x = model.model.norm(run_layers(model, torch.tensor([PROMPT[:12]]), torch.arange(12)[None]))[0].numpy()
    driver = PagedDriver(hydra_engine / "model.onnx", threads=1, num_blocks=16)
    assert driver.runner.medusa_output == contract.MEDUSA_HIDDEN and driver.runner.num_medusa_heads == 0
    out = driver.step_medusa([(0, PROMPT[:12])], medusa_rows=[3, 11, 7])
    assert out.medusa_logits is None
    np.testing.assert_allclose(out.medusa_hidden, x[[3, 11, 7]], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logits, x[-1:] @ model.model.embed_tokens.weight.detach().numpy().T, atol=1e-3,
                               rtol=0)


@pytest.mark.parametrize("min_probability", [0.0, 0.5])
def test_hydra_speculation_is_token_identical_to_plain_decoding(hydra_engine, min_probability):
    """The hydra proposer on the real graphs: greedy output as without speculation, and guesses made (random
    heads guess mostly wrong, which verification must absorb); with min_guess_probability, chains cut where
    the heads' own probability falls below it."""
    from kiln.runtime import LLM, RuntimeConfig, SamplingParams
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import SpeculativeConfig
    from kiln.runtime.speculative.hydra import HydraProposer

    prompts = [PROMPT[:n] for n in (5, 12, 20, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(load_engine(hydra_engine, RuntimeConfig(num_threads=1))).generate(prompts, params)
    spec = SpeculativeConfig("medusa", num_tokens=3, max_batch_tokens=16, min_guess_probability=min_probability)
    engine = load_engine(hydra_engine, RuntimeConfig(num_threads=1, speculative=spec))
    assert isinstance(engine.proposer, HydraProposer) and engine.proposer.num_heads == 3
    kept: list[tuple[int, ...]] = []
    keep = engine.proposer.keep
    engine.proposer.keep = lambda seqs, guesses: (kept.extend(map(tuple, guesses)), keep(seqs, guesses))
    got = LLM(engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = engine.stats()
    assert stats.num_spec_verifications > 0 and stats.num_spec_proposed_tokens > 0
    lengths = {len(g) for g in kept}
    assert lengths == {3} if not min_probability else len(lengths) > 1  # random heads: some chains cut short


def test_quantized_hydra_engine_keeps_its_hidden_output(hydra_engine, tmp_path):
    """A weight scheme quantizes the same linears as without heads (hydra heads add none to the graph), and
    medusa_hidden still comes out at the rows asked for."""
    path, count = quantized(hydra_engine, tmp_path / "hydra", "int4-q4_1")
    assert count == 2 * 4 + 1  # per layer fused qkv, o, fused gate/up, down; the LM head
    out = PagedDriver(path, threads=1, num_blocks=16).step_medusa([(0, PROMPT)], medusa_rows=[0, 5])
    fp32 = PagedDriver(hydra_engine / "model.onnx", threads=1, num_blocks=16).step_medusa([(0, PROMPT)],
                                                                                          medusa_rows=[0, 5])
    assert out.medusa_hidden.shape == fp32.medusa_hidden.shape == (2, fp32.medusa_hidden.shape[1])
    assert rel_error(out.medusa_hidden, fp32.medusa_hidden) < 0.2


def test_hydra_speculation_under_preemption_and_prefix_caching(hydra_engine):
    """One arrival per step into a pool too small for all of them (preemption), shared prefixes (prefix cache
    hits): greedy output as plain decoding's, the block manager's invariants after every step."""
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import RuntimeConfig, SamplingParams, SpeculativeConfig

    prompts = [PROMPT[:16] + PROMPT[n:n + 6] for n in range(0, 24, 3)]  # 8 prompts sharing one block
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)

    def run(speculative):
        engine = load_engine(hydra_engine, RuntimeConfig(num_threads=1, kv_cache_bytes=10 * 8192, max_model_len=160,
                                                         speculative=speculative))
        tokens: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        while pending or engine.has_unfinished():
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, params)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            engine.block_manager.check()
        return [tokens[str(i)] for i in range(len(prompts))], engine.stats()

    plain, _ = run(None)
    got, stats = run(SpeculativeConfig("medusa", num_tokens=3, max_batch_tokens=16))
    assert got == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.num_spec_verifications > 0
