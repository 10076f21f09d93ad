"""Load an engine directory: manifest checks first, then the op library's ABI, then the model."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kiln import contract
from kiln.contract import KvPoolSpec
from kiln.errors import InvalidParamError
from kiln.manifest import BACKEND_ORT_CPU, BACKEND_TENSORRT, EngineLoadError, Manifest, read_manifest
from kiln.medusa import DRAFT_FILE
from kiln.runtime.block_manager import window_tokens
from kiln.runtime.engine import Engine, EngineLimits
from kiln.runtime.model_runner import KvBudget, ModelRunner, choose_num_blocks, fit_num_blocks, short_context_warning
from kiln.runtime.params import RuntimeConfig, SpeculativeConfig
from kiln.runtime.speculative.proposer import Proposer
from kiln.runtime.structured.grammar import GrammarCompiler
from kiln.runtime.tokenizer import Tokenizer
from kiln.spec import ModelSpec
from kiln.verified_files import sha256_file
from kiln.vision import VisionSpec

NUM_THREADS_ENV = "KILN_NUM_THREADS"

if TYPE_CHECKING:  # onnxruntime is imported once an engine is opened, not with the runtime package
    from kiln.runtime.ort_runner import OrtModelRunner
    from kiln.runtime.pipeline.runner import PipelineRunner
    from kiln.runtime.tensor_parallel.runner import TensorParallelRunner
    from kiln.runtime.trt_runner import TrtModelRunner

log = logging.getLogger("kiln.runtime")


def load_engine(engine_dir: str | Path, config: RuntimeConfig | None = None) -> Engine:
    """The Engine serving an engine directory (the one factory: engine.py knows nothing of files)."""
    engine_dir, config = Path(engine_dir), config or RuntimeConfig()
    manifest = read_manifest(engine_dir)
    check_backend(manifest.backend)
    if manifest.backend == BACKEND_ORT_CPU:
        from kiln.runtime import ops

        try:
            ops.check_abi()
        except ops.OpLibraryError as exc:
            raise EngineLoadError(str(exc)) from exc
    for name in (*manifest.graph_files, "tokenizer.json"):
        if not (engine_dir / name).is_file():
            raise EngineLoadError(f"engine file {name} is missing from {engine_dir}")
    tokenizer = Tokenizer(engine_dir, config.chat_template)
    eos = list(manifest.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    # structured output's tokenizer (~1 s for 49k tokens) builds while the model opens: no request waits for it
    grammars = GrammarCompiler(tokenizer.to_json(), manifest.spec.vocab_size, eos)
    grammars.build_tokenizer(background=True)
    try:
        engine = _open_engine(engine_dir, config, manifest, tokenizer, tuple(eos))
    except BaseException:
        grammars.wait_for_build()  # a thread left inside llguidance when the interpreter exits crashes it
        raise
    try:
        grammars.tokenizer  # noqa: B018 - waits for the build: the engine is ready when it returns
    except Exception as exc:  # noqa: BLE001 - the engine serves; its structured requests get the error
        log.warning("structured output is unavailable with this tokenizer: %s", exc)
    if engine.runner.vocab_size == grammars.vocab_size:  # else the engine makes one for the logits' width
        engine.grammars = grammars
    if manifest.vision is not None:
        from kiln.runtime.vision.encoder import ImageEncoder

        engine.image_encoder = ImageEncoder(engine_dir, manifest.vision, config.num_threads or threads_from_env())
    return engine


def _open_engine(engine_dir: Path, config: RuntimeConfig, manifest: Manifest, tokenizer: Tokenizer,
                 eos: tuple[int, ...]) -> Engine:
    """The runner (KV pool sized from the config), the step limits and the proposer, as one Engine."""
    num_threads = config.num_threads or threads_from_env()
    build = manifest.build
    max_model_len = served_max_model_len(manifest.max_seq_len, config.max_model_len)
    pools = engine_kv_pools(manifest)
    step_tokens = step_token_budget(build.max_num_tokens, config.max_num_tokens, manifest.backend, num_threads)
    if config.max_num_tokens is None:
        step_tokens = room_for_image_runs(step_tokens, build.max_num_tokens, manifest.vision)
    window = kv_release_window(manifest.spec)
    # one sequence's blocks: all of its context, or with a sliding window the window and one step's chunk
    held = min(max_model_len, window_tokens(window, step_tokens, build.block_size)) if window else max_model_len
    budget = KvBudget(pools.bytes_per_block, build.block_size, min_tokens=held,
                      max_useful_tokens=config.max_num_seqs * held)
    check_tensor_parallel(engine_dir, manifest, config)
    if manifest.ranks:  # the budget covers every rank's pools (a KV head held by two ranks counts twice)
        from kiln.runtime.tensor_parallel.runner import group_bytes_per_block

        budget = dataclasses.replace(budget, bytes_per_block=group_bytes_per_block(pools, manifest.ranks))
    runner: OrtModelRunner | TrtModelRunner | PipelineRunner | TensorParallelRunner
    size_pool = choose_num_blocks if config.max_model_len is not None else fit_num_blocks
    if manifest.backend == BACKEND_TENSORRT:
        if config.pipeline_parallel > 1 or config.pipeline_micro_batches is not None:
            raise EngineLoadError("pipeline_parallel and pipeline_micro_batches are served by the onnxruntime-cpu "
                                  "backend only")
        from kiln.runtime.trt_runner import TrtModelRunner, device_free_bytes

        num_blocks = size_pool(budget, config.kv_cache_bytes, config.kv_cache_fraction, device_free_bytes())
        runner = TrtModelRunner(engine_dir, manifest, pools, num_blocks)
    else:
        num_blocks = size_pool(budget, config.kv_cache_bytes, config.kv_cache_fraction)
        if config.pipeline_parallel > 1:
            from kiln.runtime.pipeline.ray_stages import open_ray_pipeline_runner
            from kiln.runtime.pipeline.shape import StageSizing

            sizing = StageSizing(engine_kv_pools(manifest), num_blocks, num_threads, config.stage_memory_bytes)
            runner = open_ray_pipeline_runner(engine_dir, manifest.stages, sizing, config.pipeline_parallel,
                                              config.pipeline_micro_batches)
        else:
            runner = open_engine_runner(engine_dir, manifest, num_blocks, num_threads, config.pipeline_micro_batches)
    warning = short_context_warning(budget, num_blocks)
    if warning is not None:  # only with the default max_model_len: choose_num_blocks refuses a pool too small
        log.warning(warning)
        max_model_len = num_blocks * build.block_size
    limits = EngineLimits(max_seq_len=max_model_len, max_num_tokens=step_tokens, eos_token_ids=eos,
                          threads=num_threads or os.cpu_count() or 1, sliding_window=window)
    threads = num_threads or f"onnxruntime's default (one per core; {os.cpu_count()} CPUs)"
    log.info("KV pool: %d blocks of %d tokens = %d tokens, %.1f MiB; max context %d tokens; step budget %d tokens; "
             "threads: %s; prefix caching: %s", runner.num_blocks, runner.block_size,
             runner.num_blocks * runner.block_size, runner.kv_pool_bytes / 2**20, max_model_len, step_tokens, threads,
             "on" if config.enable_prefix_caching else "off")
    proposer = None
    if config.speculative is not None and config.speculative.method != "ngram":
        proposer = open_proposer(config.speculative, engine_dir, manifest, runner, num_threads)
    return Engine(runner, tokenizer, config, limits, model_name=engine_dir.resolve().name, proposer=proposer)


def check_tensor_parallel(engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
    """RuntimeConfig.tensor_parallel, when given, must be the engine's rank count (1 for a one-graph engine)."""
    have = len(manifest.ranks) or 1
    if config.tensor_parallel is not None and config.tensor_parallel != have:
        what = f"{have} tensor-parallel ranks" if manifest.ranks else "one graph (no tensor-parallel ranks)"
        raise EngineLoadError(f"--tensor-parallel {config.tensor_parallel} needs an engine of "
                              f"{config.tensor_parallel} ranks, and {engine_dir} has {what}; build it with kiln build "
                              f"--tensor-parallel {config.tensor_parallel} (or split it with kiln split "
                              f"--tensor-parallel {config.tensor_parallel})")
    if manifest.ranks and config.pipeline_parallel > 1:
        raise EngineLoadError("pipeline_parallel does not combine with a tensor-parallel engine")


def kv_release_window(spec: ModelSpec) -> int:
    """The window behind which a sequence's KV blocks can be released: the one every layer slides with; 0 when
    some layer attends to the whole context (Gemma 2/3: sliding layers between global ones keep every block)."""
    return spec.kv_window


CPU_STEP_TOKENS_PER_THREAD = 128
CPU_MIN_STEP_TOKENS = 256


def room_for_image_runs(step_tokens: int, built_for: int, vision: VisionSpec | None) -> int:
    """A default step budget raised to twice an image's tokens for an engine whose image runs are computed in one
    step (Gemma 3's bidirectional runs): room for a run beside the running decodes, so an image request is not held
    back until every running sequence finishes. At most what the graph was built for."""
    if vision is None or vision.family != "gemma3":
        return step_tokens
    return min(built_for, max(step_tokens, 2 * vision.tokens_per_image))


def step_token_budget(built_for: int, requested: int | None, backend: str, num_threads: int | None) -> int:
    """Tokens one step computes (RuntimeConfig.max_num_tokens), at most what the graph was built for.

    A step's length is the stall every running stream sees and the wait of every prompt that finishes in it. A GPU
    computes the built-for budget (2048 by default) in milliseconds; two CPU cores need ~3 s, so on the CPU backend
    the default keeps a step near ~0.4 s (128 tokens per thread, at least 256): prompts then finish one after
    another in arrival order and streams keep moving, for a few percent of prefill speed (docs/design.md)."""
    if requested is not None:
        if requested > built_for:
            raise InvalidParamError(f"max_num_tokens {requested} is more than the {built_for} tokens per step this "
                                    "engine was built for (its manifest's build.max_num_tokens)", "max_num_tokens")
        return requested
    if backend != BACKEND_ORT_CPU:
        return built_for
    threads = num_threads or os.cpu_count() or 1
    return min(built_for, max(CPU_MIN_STEP_TOKENS, CPU_STEP_TOKENS_PER_THREAD * threads))


def threads_from_env() -> int | None:
    """KILN_NUM_THREADS: the thread count of engines whose RuntimeConfig leaves num_threads unset (as
    OMP_NUM_THREADS is for OpenMP programs), e.g. one thread per test worker or per co-located server."""
    value = os.environ.get(NUM_THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise InvalidParamError(f"{NUM_THREADS_ENV} must be a positive integer, got {value!r}", "num_threads")
    return int(value)


def check_backend(backend: str) -> None:
    """The runtime serves ONNX Runtime CPU engines, and TensorRT engines where tensorrt and cuda-python import."""
    if backend == BACKEND_ORT_CPU:
        return
    if backend == BACKEND_TENSORRT:
        missing = [m for m in ("tensorrt", "cuda") if importlib.util.find_spec(m) is None]
        if not missing:
            return
        raise EngineLoadError(f"engine backend {backend!r} is not available in this runtime: serving it needs a CUDA "
                              f"GPU with TensorRT 10 and cuda-python, and {' and '.join(missing)} cannot be imported")
    raise EngineLoadError(f"engine backend {backend!r} is not available in this runtime (it serves "
                          f"{BACKEND_ORT_CPU!r} and {BACKEND_TENSORRT!r})")


def open_proposer(spec: SpeculativeConfig, engine_dir: Path, manifest: Manifest, target: ModelRunner,
                  num_threads: int | None) -> Proposer:
    """The proposer of a speculative method that needs more than the engine loop: the Medusa heads compiled
    into the target, or a draft engine (checked against the target)."""
    if spec.method == "medusa":
        if manifest.medusa is not None and manifest.medusa.kind == "hydra":
            from kiln.runtime.speculative.hydra import HydraProposer

            return HydraProposer(engine_dir / DRAFT_FILE, min_probability=spec.guess_probability(hydra=True))
        if not target.num_medusa_heads:
            raise EngineLoadError(f"speculative method 'medusa' needs Medusa heads in the engine, and {engine_dir} "
                                  "has none (build it with kiln build --medusa HEADS_DIR, or use --speculative ngram "
                                  "or draft)")
        from kiln.runtime.speculative.medusa import MedusaProposer

        return MedusaProposer(target.num_medusa_heads, min_probability=spec.guess_probability(hydra=False))
    from kiln.runtime.speculative.draft import DraftProposer

    assert spec.draft_engine is not None  # SpeculativeConfig requires it for 'draft'
    draft_dir = Path(spec.draft_engine)
    draft = read_manifest(draft_dir)
    if draft.backend != BACKEND_ORT_CPU:
        raise EngineLoadError(f"draft engine backend {draft.backend!r} is not available in this runtime")
    if sha256_file(draft_dir / "tokenizer.json") != sha256_file(engine_dir / "tokenizer.json"):
        raise EngineLoadError(f"draft engine {draft_dir} has another tokenizer than {engine_dir}: its token ids "
                              "would mean other text")
    if draft.max_seq_len < manifest.max_seq_len:
        raise EngineLoadError(f"draft engine max_seq_len {draft.max_seq_len} is below the target's "
                              f"{manifest.max_seq_len}")
    # room for as many tokens as the target's pool holds
    tokens = target.num_blocks * target.block_size
    runner = open_engine_runner(draft_dir, draft, -(-tokens // draft.build.block_size), num_threads)
    if runner.vocab_size != target.vocab_size:
        raise EngineLoadError(f"draft engine vocabulary ({runner.vocab_size}) differs from the target's "
                              f"({target.vocab_size})")
    log.info("draft engine %s: KV pool of %d blocks (%.1f MiB)", draft_dir, runner.num_blocks,
             runner.kv_pool_bytes / 2**20)
    return DraftProposer(runner)


def served_max_model_len(built: int, requested: int | None) -> int:
    """The longest sequence served: the engine's max_seq_len, or less when asked; never more
    (the graph was built and tested up to it)."""
    if requested is None:
        return built
    if requested > built:
        raise InvalidParamError(f"max_model_len {requested} exceeds the engine's max_seq_len {built}; rebuild "
                                f"the engine with --max-seq-len {requested} to serve longer sequences", "max_model_len")
    return requested


def engine_kv_pools(manifest: Manifest) -> KvPoolSpec:
    spec, build = manifest.spec, manifest.build
    if build.kv_dtype not in contract.KV_DTYPES:
        raise EngineLoadError(f"engine KV dtype {build.kv_dtype!r} is not supported by this runtime "
                              f"(supported: {list(contract.KV_DTYPES)})")
    return KvPoolSpec(spec.num_layers, spec.num_kv_heads, build.block_size, spec.head_dim, build.kv_dtype)


def open_engine_runner(
    engine_dir: Path, manifest: Manifest, num_blocks: int, num_threads: int | None,
    micro_batches: int | None = None,
) -> OrtModelRunner | PipelineRunner | TensorParallelRunner:
    """The engine's graph in an OrtModelRunner with num_blocks blocks per layer, pools as its manifest says; a
    staged engine's graphs in a PipelineRunner (num_threads per stage, one after another in this process, each step
    as micro_batches micro-batches); a tensor-parallel engine's ranks in their processes (num_threads each,
    default 1)."""
    if micro_batches is not None and not manifest.stages:
        raise EngineLoadError(f"pipeline_micro_batches is for an engine of pipeline stages (kiln build "
                              f"--pipeline-stages N), and {engine_dir} is one graph")
    if manifest.ranks:
        from kiln.runtime.tensor_parallel.runner import open_tensor_parallel_runner

        return open_tensor_parallel_runner(engine_dir, manifest, engine_kv_pools(manifest), num_blocks,
                                           num_threads or 1, manifest.build.max_num_tokens)
    if manifest.stages:
        from kiln.runtime.pipeline.runner import open_pipeline_runner
        from kiln.runtime.pipeline.shape import StageSizing

        return open_pipeline_runner(engine_dir, manifest.stages, StageSizing(engine_kv_pools(manifest), num_blocks,
                                                                             num_threads), micro_batches)
    from kiln.runtime.ort_runner import OrtModelRunner, open_session

    session = open_session(engine_dir / "model.onnx", num_threads)
    return OrtModelRunner(session, engine_kv_pools(manifest), num_blocks)
