"""build_engine: checkpoint -> exported graph -> optimized graph -> engine directory + manifest.

The exported graph stays in memory with lazy weight initializers (export/lazy_initializers.py): a pass
reads a weight when it needs it, quantization keeps only the quantized tensors, and the engine writer
reads each remaining float tensor as it writes it, so the model's fp32 weights never exist at once.

    kiln build MODEL -o DIR      (cli/commands.py)

Stages report to stderr with their elapsed time; the optimizer passes print how often each
fired. The result is loaded once in ONNX Runtime with the kiln op library before returning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import onnx_ir as ir

from kiln import contract
from kiln.errors import KilnError
from kiln.export.progress import print_above_bars, progress_bar
from kiln.manifest import (
    BACKEND_ORT_CPU,
    BACKEND_TENSORRT,
    MANIFEST_NAME,
    BuildOptions,
    Manifest,
    write_manifest,
)
from kiln.optimize._common import PAGE_BYTES
from kiln.optimize.attach_attend_until import attach_attend_until
from kiln.optimize.attach_image_inputs import attach_image_inputs
from kiln.optimize.attach_medusa import MedusaGraphError, attach_hidden, attach_medusa
from kiln.optimize.fuse_attention import AttentionConfig
from kiln.optimize.lower_onnxruntime import lower_for_onnxruntime
from kiln.optimize.medusa_draft import build_draft_graph, save_draft_graph
from kiln.optimize.pack_attention_inputs import has_qk_norms
from kiln.optimize.pack_gguf_records import holds_newer_records, pack_gguf_records
from kiln.optimize.pack_q4_1_records import holds_q4_1_centres, pack_moe_q4_1_records, pack_q4_1_records
from kiln.optimize.pipeline import optimize_model
from kiln.optimize.quantize import QuantizationError, check_lm_head, int8_fallback, prepare_checkpoint, quantize_model
from kiln.optimize.quantize import check_options as check_quantization
from kiln.optimize.shard_tensor_parallel import check_splittable, split_into_ranks
from kiln.optimize.split_stages import StageSplitError, split_into_stages
from kiln.optimize.vision_encoder import EncoderQuantizationError, optimize_encoder
from kiln.pipeline_stages import stage_layer_ranges
from kiln.quant_scheme import LmHead, QuantMethod
from kiln.vision import EncoderQuantization

Progress = Callable[[str], None]
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


class BuildError(KilnError, RuntimeError):
    """The model cannot be built into an engine; the message says why."""


def stderr_progress(message: str) -> None:
    print_above_bars(f"[kiln build] {message}")


DEFAULT_BUILD_OPTIONS = BuildOptions()  # frozen: one shared default is safe


def build_engine(
    model_path: str | Path, out_dir: str | Path, options: BuildOptions = DEFAULT_BUILD_OPTIONS,
    progress: Progress | None = None, backend: str = BACKEND_ORT_CPU, mmproj: str | Path | None = None,
) -> Manifest:
    """Build the engine directory out_dir from an HF dir, a .gguf file or "default", for `backend`; with
    ``mmproj`` (llama.cpp's image encoder file of a LLaVA-1.5 GGUF) a vision-language engine.

    Everything is checked before the export starts; the engine is written into a hidden directory
    beside out_dir and moved into place only once complete and verified, so a failed or interrupted
    build leaves out_dir as it was (absent, or the previous engine). A TensorRT engine gets its graph
    lowered for TensorRT's parser (optimize/lower_tensorrt.py) and, where tensorrt is importable, its plan."""
    say = progress or stderr_progress
    _check_options(options)
    _check_backend(options, backend)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    from kiln.export.onnx_export import export_model

    with _stage(say, "load checkpoint"):
        checkpoint = _load_checkpoint(model_path)
        options = _check_model(checkpoint, options)
        vision = _load_vision(model_path, backend, checkpoint, mmproj, options.vision_quantization)
        if vision is not None and options.pipeline_stages > 1:  # the stage runners bind no image inputs
            raise BuildError("--pipeline-stages is not supported for vision-language models yet")
        if options.tensor_parallel > 1:
            try:
                check_splittable(backend, options, checkpoint.spec, vision is not None or options.medusa is not None)
            except KilnError as exc:
                raise BuildError(str(exc)) from exc
        try:
            heads = _medusa_heads(checkpoint, options.medusa, say) if options.medusa is not None else None
            if heads is not None and heads.kind != "hydra" and options.lm_head is LmHead.INT4_RESCORED:
                raise BuildError("Medusa heads share the LM head's rows and do not combine with --lm-head "
                                 "int4-rescored; use hydra heads (kiln train-medusa --kind hydra) or another head")
            draft = _draft_graph(checkpoint, heads) if heads is not None and heads.kind == "hydra" else None
            checkpoint = prepare_checkpoint(checkpoint, options.quantization, _scheme_artifact(options), say)
            int8_modules = int8_fallback(options.quantization, _scheme_artifact(options))
        except QuantizationError as exc:
            raise BuildError(str(exc)) from exc
        kv_scales = _kv_scales(checkpoint, options.calibration, say) if options.kv_dtype == "int8" else None
    spec = checkpoint.spec.for_context(options.max_seq_len)  # LongRoPE: the factor set this context uses
    say(f"model: {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}, "
        f"context {options.max_seq_len}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.building-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()  # not mkdtemp: the engine dir gets the umask's permissions, not 0700
    try:
        with _stage(say, "export onnx"):
            model = export_model(dataclasses.replace(checkpoint, spec=spec), say)
        with _stage(say, "optimize"):
            windows = tuple(spec.layer_window(i) for i in range(spec.num_layers))
            attention = AttentionConfig(options.kv_dtype, options.block_size, windows, kv_scales,
                                        rotary_positions=options.max_seq_len)
            counts = optimize_model(model, attention)
            counts.update(_lower(model, backend))
            for name, count in counts.items():
                say(f"  {name}: fired {count}x")
            _check_counts(counts, spec.num_layers)
            if vision is not None:
                scaled = vision.spec.family == "gemma3"  # its image rows replace the scaled embeddings
                say(f"  attach_image_inputs: fired {attach_image_inputs(model, spec.hidden_size, scaled)}x")
                if vision.spec.family == "gemma3":  # the tokens of one image see each other
                    say(f"  attach_attend_until: fired {attach_attend_until(model)}x")
            if heads is not None:
                try:
                    if heads.kind == "hydra":
                        attach_hidden(model)
                        say(f"  attach_hidden: the final norm's output at medusa_indices, for {heads.num_heads} "
                            "hydra heads")
                    else:
                        say(f"  attach_medusa: {attach_medusa(model, *heads.arrays())} heads")
                except MedusaGraphError as exc:
                    raise BuildError(str(exc)) from exc
        if options.quantization.method is not QuantMethod.NONE:
            with _stage(say, f"quantize {options.quantization}"):
                try:
                    quantize_model(model, options.quantization, options.lm_head, say, int8_modules)
                except QuantizationError as exc:
                    raise BuildError(str(exc)) from exc
        with _stage(say, "write engine"):
            say(f"  pack_q4_1_records: fired {pack_q4_1_records(model)}x")  # last: the kernels' layout, stored
            moe_records = pack_moe_q4_1_records(model)
            say(f"  pack_moe_q4_1_records: fired {moe_records}x")
            gguf_records = pack_gguf_records(model)
            say(f"  pack_gguf_records: fired {gguf_records}x")
            held = {"moe_records": moe_records > 0, "gguf_records": gguf_records > 0,
                    "qk_norms": has_qk_norms(model),  # kiln.PagedAttention's q_norm / k_norm inputs
                    "newer_records": holds_newer_records(model), "q4_1_centres": holds_q4_1_centres(model)}
            needs = {need for need, yes in held.items() if yes}  # the op-library features the graph uses
            _save_graph(model, staging)
            try:
                stages = split_into_stages(staging, spec, options.pipeline_stages, say)
            except StageSplitError as exc:
                raise BuildError(str(exc)) from exc
            try:
                ranks = split_into_ranks(staging, spec, options.tensor_parallel, say)
            except KilnError as exc:
                raise BuildError(str(exc)) from exc
            _write_tokenizer(checkpoint, staging)
            if draft is not None:
                say(f"  {save_draft_graph(draft, staging).name}: the hydra heads' chain")
        if vision is not None:
            with _stage(say, "export vision encoder"):
                say(f"  {', '.join(_write_vision(vision, staging, options.vision_quantization, say))}")
        graph_inputs = tuple(v.name for v in model.graph.inputs)
        graph_outputs = tuple(v.name for v in model.graph.outputs)
        del model
        _release_memory()  # the graph's quantized weights go before onnxruntime loads the engine
        manifest = Manifest(
            spec=spec, build=options, backend=backend, graph_inputs=graph_inputs,
            graph_outputs=graph_outputs, medusa=None if heads is None else heads.spec(), stages=stages, ranks=ranks,
            vision=None if vision is None else vision.spec,
            op_library_abi=contract.engine_abi(needs),
        )
        with _stage(say, "manifest"):
            manifest = write_manifest(staging, manifest)
        if backend == BACKEND_TENSORRT:
            manifest = _finish_tensorrt(staging, say)
        else:
            with _stage(say, "verify (load in onnxruntime)"):
                verify_engine(staging, manifest.graph_files)
        _move_into_place(staging, out_dir)
    except OSError as exc:  # a full disk reads as numpy's "problem writing element N to file"
        raise BuildError(_write_failure(exc, out_dir)) from exc
    finally:  # after a failure (or Ctrl-C) the half-written engine goes; after _move_into_place it is gone
        shutil.rmtree(staging, ignore_errors=True)
    say(f"engine written to {out_dir}")
    return manifest


def _write_failure(exc: OSError, out_dir: Path) -> str:
    """What a failed write says, with the free space where the build writes (its temp dir, the engine's)."""
    places = []
    for place in dict.fromkeys((Path(tempfile.gettempdir()), out_dir.parent)):
        try:
            places.append(f"{shutil.disk_usage(place).free / 2**30:.1f} GiB free in {place}")
        except OSError:
            continue
    return f"writing the engine failed ({exc}); {', '.join(places)}"


def _release_memory() -> None:
    """Free what the dropped graph held (the IR's cycles need the collector) and hand the freed heap back to the
    system (glibc keeps it otherwise), so verifying does not stack onnxruntime's copy of the engine on the
    build's: the peak of an 8B build is then one engine, not two."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass


def verify_engine(engine_dir: str | Path, graphs: tuple[str, ...] = (MODEL_FILE,)) -> None:
    """Create an ONNX Runtime session on each engine graph with the kiln op library registered."""
    import onnxruntime as ort

    from kiln.runtime.ops import library_path

    session_options = ort.SessionOptions()
    session_options.register_custom_ops_library(library_path())
    names: set[str] = set()
    for graph in graphs:  # one at a time: a stage's session goes before the next one loads
        session = ort.InferenceSession(str(Path(engine_dir) / graph), session_options,
                                       providers=["CPUExecutionProvider"])
        names.update(i.name for i in session.get_inputs())
        del session
    missing = {contract.INPUT_IDS, contract.POSITION_IDS, contract.LOGITS_INDICES} - names
    if missing:
        raise BuildError(f"the built graph lacks the inputs {sorted(missing)}")


def _check_backend(options: BuildOptions, backend: str) -> None:
    if backend not in (BACKEND_ORT_CPU, BACKEND_TENSORRT):
        raise BuildError(f"backend {backend!r} is not one of {[BACKEND_ORT_CPU, BACKEND_TENSORRT]}")
    if backend == BACKEND_TENSORRT and options.quantization.method is not QuantMethod.NONE:
        raise BuildError(f"--backend tensorrt serves float weights; --quantization {options.quantization} makes "
                         "ONNX Runtime CPU kernels (build it without --quantization)")
    if backend == BACKEND_TENSORRT and options.pipeline_stages > 1:
        raise BuildError("--pipeline-stages is supported with the onnxruntime-cpu backend only")
    if backend == BACKEND_TENSORRT and options.medusa is not None:
        raise BuildError("--medusa is not supported with --backend tensorrt yet (its runner reads the logits only)")


def _lower(model: ir.Model, backend: str) -> dict[str, int]:
    """The backend's lowering of the neutral graph (its fusions, its op forms); how often each step fired."""
    if backend != BACKEND_TENSORRT:
        return lower_for_onnxruntime(model)
    from kiln.optimize.lower_tensorrt import TensorRTLoweringError, lower_for_tensorrt

    try:
        return {f"lower_tensorrt.{name}": count for name, count in lower_for_tensorrt(model).items()}
    except TensorRTLoweringError as exc:
        raise BuildError(str(exc)) from exc


def _finish_tensorrt(staging: Path, say: Progress) -> Manifest:
    """Check the lowered graph (the ONNX checker: ONNX Runtime cannot load plugin nodes) and add the plan where
    TensorRT is importable; elsewhere the engine keeps graph and manifest, and its plan is built later."""
    import onnx

    from kiln.manifest import read_manifest

    with _stage(say, "verify (onnx checker)"):
        onnx.checker.check_model(str(staging / MODEL_FILE))
    if importlib.util.find_spec("tensorrt") is None:
        say("tensorrt is not importable here, so the engine has no model.plan yet: run `python -m "
            "kiln.plugins_trt.trt_build ENGINE_DIR` on the GPU machine that will serve it")
        return read_manifest(staging)
    from kiln.plugins_trt.trt_build import add_plan

    with _stage(say, "TensorRT plan"):
        return add_plan(staging, say)


@contextmanager
def _stage(say: Progress, name: str):
    start = time.perf_counter()
    say(f"{name} ...")
    yield
    say(f"{name} done in {time.perf_counter() - start:.1f}s")


def _load_checkpoint(model_path: str | Path):
    from kiln.export.checkpoint import load_checkpoint

    try:
        return load_checkpoint(model_path)
    except (FileNotFoundError, ValueError) as exc:  # the exporter names an unusable model source in one sentence
        raise BuildError(str(exc)) from exc


def _load_vision(model_path: str | Path, backend: str, checkpoint, mmproj: str | Path | None,
                 quantization: EncoderQuantization):
    """A vision-language checkpoint's image side (export/vision/; from the mmproj file when given), or None for a
    text-only model."""
    from kiln.export.vision.export_encoder import load_vision_of

    try:
        vision = load_vision_of(model_path)
        if mmproj is not None:
            if vision is not None:
                raise BuildError(f"{model_path} has its own image encoder; --mmproj goes with a text model")
            from kiln.export.vision.mmproj import load_mmproj

            vision = load_mmproj(mmproj, checkpoint)
    except (FileNotFoundError, ValueError) as exc:
        raise BuildError(str(exc)) from exc
    if vision is not None and backend != BACKEND_ORT_CPU:
        raise BuildError(f"vision-language engines build for {BACKEND_ORT_CPU} only, not {backend}")
    if vision is None and quantization is not EncoderQuantization.FLOAT32:
        raise BuildError(f"--vision-quantization {quantization.value} quantizes a vision-language model's image "
                         f"encoder, and {model_path} is a text-only model (build it without --vision-quantization)")
    return vision


def _write_vision(vision, staging: Path, quantization: EncoderQuantization, say: Progress) -> list[str]:
    from kiln.export.vision.export_encoder import export_encoder, write_vision

    encoder = export_encoder(vision)
    try:
        counts = optimize_encoder(encoder, quantization)
    except EncoderQuantizationError as exc:
        raise BuildError(str(exc)) from exc
    for name, count in counts.items():
        say(f"  {name}: fired {count}x")
    return write_vision(vision, staging, encoder)


def _scheme_artifact(options: BuildOptions) -> Path | None:
    """The artifact the quantization scheme folds in: with an int8 KV cache the artifact may serve
    the KV scales alone (a scheme that needs no calibration then ignores it)."""
    if options.kv_dtype == "int8" and not options.quantization.calibration:
        return None
    return options.calibration


def _kv_scales(checkpoint, calibration: Path | None, say: Progress):
    """float32 [num_layers, 2, Hkv]: the artifact's per-head K and V int8 steps (absmax / 127)."""
    import numpy as np

    from kiln.calibration.artifact import CalibrationArtifact, CalibrationError, check_fingerprint

    try:
        artifact = CalibrationArtifact.load(calibration)
        check_fingerprint(artifact, checkpoint)
        k, v = artifact.kv_scales()
    except CalibrationError as exc:
        raise BuildError(str(exc)) from exc
    except KeyError as exc:
        raise BuildError(f"the calibration artifact {calibration} holds no KV statistics ({exc.args[0]}); "
                         f"rerun `kiln calibrate` to make one that does") from exc
    spec = checkpoint.spec
    scales = np.stack([k.numpy(), v.numpy()], axis=1).astype(np.float32)
    if scales.shape != (spec.num_layers, 2, spec.num_kv_heads):
        raise BuildError(f"the calibration artifact {calibration} has KV scales of shape {list(scales.shape[::2])}, "
                         f"not [{spec.num_layers}, {spec.num_kv_heads}] (layers, KV heads) as this model needs")
    # an all-zero head would give step 0: any positive step stores its zeros exactly
    scales = np.maximum(scales, np.float32(1e-8))
    say(f"int8 KV cache: K steps {scales[:, 0].min():.3g}..{scales[:, 0].max():.3g}, "
        f"V steps {scales[:, 1].min():.3g}..{scales[:, 1].max():.3g} from {calibration}")
    return scales


def _medusa_heads(checkpoint, medusa: Path, say: Progress):
    """The artifact's heads, checked against the checkpoint they will read (before any scales are folded:
    the folding leaves the final hidden state unchanged, so the heads fit every weight scheme)."""
    from kiln.heads.medusa_heads import MedusaArtifact, MedusaError

    try:
        artifact = MedusaArtifact.load(medusa)
        artifact.check_model(checkpoint)
    except MedusaError as exc:
        raise BuildError(str(exc)) from exc
    say(f"{artifact.num_heads} Medusa heads from {medusa} (held-out top-1 accuracy "
        f"{artifact.spec().top1_accuracy})")
    return artifact


def _draft_graph(checkpoint, heads):
    """The hydra heads' draft graph, on the checkpoint's own embedding and LM head (before any scheme's
    folding touches them: the heads were trained on these)."""
    from kiln.export.checkpoint_types import lm_head_weight_name

    weights = checkpoint.weights
    embed = weights["model.embed_tokens.weight"].float().numpy()
    lm_head = weights[lm_head_weight_name(checkpoint.spec)].float().numpy()
    return build_draft_graph(*heads.hydra_arrays(), embed, lm_head)


def _check_options(options: BuildOptions) -> None:
    """What BuildOptions cannot check field by field: the artifact each choice needs, given or refused."""
    try:
        check_quantization(options.quantization, _scheme_artifact(options))
        check_lm_head(options.quantization, options.lm_head)
    except QuantizationError as exc:
        raise BuildError(str(exc)) from exc
    if options.kv_dtype == "int8" and options.calibration is None:
        raise BuildError("an int8 KV cache needs the per-head K/V scales of a calibration artifact: run "
                         "`kiln calibrate MODEL --method smoothquant -o DIR` (any method) and pass --calibration DIR")


def _check_counts(counts: dict[str, int], num_layers: int) -> None:
    if counts["fuse_attention"] != num_layers:
        raise BuildError(
            f"attention fused in {counts['fuse_attention']} of {num_layers} layers; the exported graph's "
            f"attention did not match the PagedAttention pattern"
        )
    if counts["select_logits"] != 1:
        raise BuildError("could not find the LM head (the graph's logits are not produced by a MatMul)")


def _check_model(checkpoint, options: BuildOptions) -> BuildOptions:
    """What the model decides before any work: a tokenizer to ship, and the context (max_seq_len: the model's
    own, ModelSpec.context_length, unless given; never past it). The graph holds nothing sized by the context
    but RoPE's cos/sin tables (max_seq_len x rotary_dim float32, 64 MiB at 128k for head_dim 128); the KV
    pool is sized by the server at load time."""
    if checkpoint.tokenizer is None:
        raise BuildError(f"{checkpoint.source} carries no tokenizer (tokenizer.json); an engine needs one")
    spec = checkpoint.spec
    try:
        stage_layer_ranges(spec.num_layers, options.pipeline_stages)
    except KilnError as exc:
        raise BuildError(str(exc)) from exc
    limit = spec.context_length
    if options.max_seq_len is None:
        return dataclasses.replace(options, max_seq_len=limit)
    if options.max_seq_len > limit:
        context = f"max_position_embeddings {spec.max_position_embeddings}"
        if limit > spec.max_position_embeddings and spec.rope_scaling is not None:
            context = f"{limit}: its {spec.rope_scaling.rope_type} rope scaling stretches {context}"
        raise BuildError(f"max_seq_len {options.max_seq_len} is longer than the model's context ({context}); "
                         f"build with --max-seq-len {limit} or less")
    return options


def _check_out_dir(out_dir: Path) -> None:
    """An existing engine dir may be replaced; any other non-empty path is refused."""
    is_engine_dir = (out_dir / MANIFEST_NAME).is_file()
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not is_engine_dir)):
        raise BuildError(f"{out_dir} exists, is not empty and is not a kiln engine directory; refusing to overwrite it")


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename the complete engine to out_dir; a previous engine there is set aside first and deleted last."""
    _check_out_dir(out_dir)  # again: the build took minutes
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    previous = staging.with_name(staging.name.replace(".building-", ".previous-"))
    out_dir.rename(previous)
    staging.rename(out_dir)
    shutil.rmtree(previous)


def _save_graph(model: ir.Model, engine_dir: Path) -> None:
    """model.onnx + its weights in model.onnx.data, each on a page boundary (ONNX Runtime maps them from the file, and
    kernels that read their tensors in place, kiln.MatMulQ4_1's records, find them on whole cache lines), with a bar
    over the tensors written."""
    with progress_bar("write engine", unit="tensor") as bar:
        def written(_tensor, info) -> None:
            bar.total = info.total
            bar.update(1)

        ir.save(model, engine_dir / MODEL_FILE, external_data=DATA_FILE, callback=written, alignment=PAGE_BYTES,
                align_threshold=0)


def _write_tokenizer(checkpoint, out_dir: Path) -> None:
    (out_dir / "tokenizer.json").write_text(checkpoint.tokenizer.tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(checkpoint.tokenizer.tokenizer_config, indent=2))
