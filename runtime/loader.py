"""Load an engine directory: manifest checks first, then the op library's ABI, then the model."""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.manifest import BACKEND_ORT_CPU, EngineLoadError, read_manifest
from kiln.runtime.engine import Engine, EngineLimits
from kiln.runtime.params import RuntimeConfig
from kiln.runtime.tokenizer import Tokenizer

log = logging.getLogger("kiln.runtime")


def load_engine(engine_dir: str | Path, config: RuntimeConfig | None = None) -> Engine:
    """The Engine serving an engine directory (the one factory: engine.py knows nothing of files)."""
    engine_dir, config = Path(engine_dir), config or RuntimeConfig()
    manifest = read_manifest(engine_dir)
    if manifest.backend != BACKEND_ORT_CPU:
        raise EngineLoadError(
            f"engine backend {manifest.backend!r} is not available in this runtime (it serves {BACKEND_ORT_CPU!r})"
        )
    from kiln.runtime import ops

    try:
        ops.check_abi()
        library = ops.library_path()
    except ops.OpLibraryError as exc:
        raise EngineLoadError(str(exc)) from exc
    for name in ("model.onnx", "tokenizer.json"):
        if not (engine_dir / name).is_file():
            raise EngineLoadError(f"engine file {name} is missing from {engine_dir}")
    from kiln.runtime.ort_runner import OrtModelRunner

    tokenizer = Tokenizer(engine_dir)
    runner = OrtModelRunner(engine_dir, manifest, config, library)
    eos = list(manifest.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    limits = EngineLimits(
        max_seq_len=manifest.build.max_seq_len,
        max_num_tokens=manifest.build.max_num_tokens,
        eos_token_ids=tuple(eos),
    )
    log.info("KV pool: %d blocks of %d tokens per layer (%.1f MiB in all)", runner.num_blocks, runner.block_size,
             runner.kv_pool_bytes / 2**20)
    return Engine(runner, tokenizer, config, limits, model_name=engine_dir.resolve().name)
