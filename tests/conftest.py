"""Shared fixtures: engines built once per session (tiny) or once per kiln source (SmolLM2).

The tiers are folders: unit/ builds no engine (`make test-fast`); engine/ (tiny-engine end to
end) and golden/ (numerics against PyTorch/HF, SmolLM2) build or load engines and carry the
`engine` marker, given here per folder so a new test file cannot forget it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Triton kernels run in Triton's CPU interpreter in `make test` (tests/unit/test_triton_*.py). Triton reads
# TRITON_INTERPRET when it is first imported, and any file collected earlier may import it (tests/gpu does, to
# skip), so it is set here, before any test module; tools/gpu_check.py (compiled kernels on a GPU) opts out.
if not os.environ.get("KILN_GPU_CHECK"):
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on two cores: one thread each (ONNX Runtime through
    # KILN_NUM_THREADS, torch through OMP_NUM_THREADS, read at its import), inherited by the servers
    # the tests start, so the workers never oversubscribe the cores with spinning thread pools.
    os.environ.setdefault("KILN_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
ENGINE_CACHE = REPO / ".cache" / "engines"
# The sources that decide what `kiln build` writes; a change to any of them rebuilds cached engines.
_BUILD_SOURCES = ("kiln", "export", "optimize")
_ENGINE_TIERS = tuple(REPO / "tests" / tier for tier in ("engine", "golden"))
UNIT_TIER = REPO / "tests" / "unit"


# Free disk the suite needs at its start: its engine builds (fp32 exports, SmolLM2 engines in .cache/, tiny engines
# in pytest's temp dirs) peak at about 5 GiB. With less, hundreds of tests fail at once on a full disk, and the
# errors hide the cause. KILN_TEST_MIN_FREE_GIB overrides the bound.
MIN_FREE_GIB = float(os.environ.get("KILN_TEST_MIN_FREE_GIB", "6"))


def pytest_sessionstart(session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller checked
    here = session.config.invocation_params.dir
    paths = [(here / arg.split("::")[0]).resolve() for arg in session.config.args]
    if paths and all(p == UNIT_TIER or UNIT_TIER in p.parents for p in paths):
        return  # unit tests build no engine
    for where in (tempfile.gettempdir(), REPO):
        free_gib = shutil.disk_usage(where).free / 2**30
        if free_gib < MIN_FREE_GIB:
            pytest.exit(f"only {free_gib:.1f} GiB free on the disk of {where}: the suite's engine builds need about "
                        f"{MIN_FREE_GIB:g} GiB (earlier runs' temp dirs, e.g. {tempfile.gettempdir()}/pytest-of-*, "
                        "can go; KILN_TEST_MIN_FREE_GIB sets the bound)", returncode=3)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if any(tier in item.path.parents for tier in _ENGINE_TIERS):
            item.add_marker(pytest.mark.engine)


def kiln_source_hash() -> str:
    digest = hashlib.sha256()
    for folder in _BUILD_SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@pytest.fixture
def recorded_bars(monkeypatch) -> list[tuple[str, int, int | None]]:
    """(description, steps done, total) of each build-stage progress bar, as it closes."""
    from tqdm import tqdm

    closed: list[tuple[str, int, int | None]] = []

    class Recording(tqdm):
        def close(self) -> None:
            if not getattr(self, "_recorded", False):
                self._recorded = True
                closed.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr("kiln.export.progress.tqdm", Recording)
    return closed


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random llama checkpoint (HF format + tokenizer)."""
    from helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-model"), family="llama")


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny llama built into an engine dir (fp32 weights and KV cache, block size 16): the tests that hold
    an engine to the reference's logits at 1e-4 use it, so its KV is float32, not the build's float16 default."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("tiny-engine") / "engine"
    build_engine(tiny_model_dir, out, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return out


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA-1.5 checkpoint (tests/vision_fixtures.py)."""
    from vision_fixtures import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_llava_engine(tmp_path_factory, tiny_llava_dir) -> Path:
    """The tiny LLaVA built into a vision-language engine dir (fp32 weights and KV cache, block size 16)."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("tiny-llava-engine") / "engine"
    build_engine(tiny_llava_dir, out, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return out


@pytest.fixture(scope="session")
def tiny_llava_next_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA-NeXT checkpoint (tests/llava_next_fixtures.py)."""
    from llava_next_fixtures import make_tiny_llava_next

    return make_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next"))


@pytest.fixture(scope="session")
def tiny_llava_next_engine(tmp_path_factory, tiny_llava_next_dir) -> Path:
    """The tiny LLaVA-NeXT built into a vision-language engine dir (fp32 weights and KV cache, block size 16)."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("tiny-llava-next-engine") / "engine"
    build_engine(tiny_llava_next_dir, out, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return out


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory) -> Path:
    """A tiny random SmolVLM (Idefics3 family) checkpoint with the SmolLM2 tokenizer (tests/smolvlm_fixtures.py)."""
    from smolvlm_fixtures import make_tiny_smolvlm

    return make_tiny_smolvlm(tmp_path_factory.mktemp("tiny-smolvlm"))


@pytest.fixture(scope="session")
def tiny_smolvlm_engine(tmp_path_factory, tiny_smolvlm_dir) -> Path:
    """The tiny SmolVLM built into a vision-language engine dir (fp32 weights and KV cache, block size 16)."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("tiny-smolvlm-engine") / "engine"
    build_engine(tiny_smolvlm_dir, out, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return out


@pytest.fixture(scope="session")
def smollm2_engine() -> Path:
    """SmolLM2-135M-Instruct fp32 (weights and KV cache: the golden tests hold its logits to HF's at 1e-3),
    built once into .cache/engines/smollm2-fp32 and reused while the kiln build sources are unchanged (a file
    lock keeps concurrent test runs from racing)."""
    from kiln.export.checkpoint import default_model_path
    from kiln.manifest import BuildOptions

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return cached_engine("smollm2-fp32", "default", BuildOptions(kv_dtype="float32"))


@pytest.fixture(scope="session")
def smollm2_q4_1_engine(smollm2_engine) -> Path:
    """SmolLM2-135M-Instruct with int4-q4_1 weights (the draft of the speculative tests), cached likewise."""
    from kiln.manifest import BuildOptions
    from kiln.quant_scheme import QuantScheme

    return cached_engine("smollm2-q4_1", "default", BuildOptions(quantization=QuantScheme.parse("int4-q4_1")))


def cached_engine(name: str, model: str, options=None) -> Path:
    from kiln.manifest import BuildOptions, EngineLoadError, read_manifest
    from kiln.optimize.build import build_engine

    ENGINE_CACHE.mkdir(parents=True, exist_ok=True)
    engine = ENGINE_CACHE / name
    stamp = ENGINE_CACHE / f"{name}.source-sha256"
    options = options or BuildOptions()
    source = f"{kiln_source_hash()} {json.dumps(options.to_dict(), sort_keys=True)}"  # new options rebuild it too
    with open(ENGINE_CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == source:
            try:
                read_manifest(engine, verify_checksums=False)
                return engine
            except EngineLoadError:
                pass
        stamp.unlink(missing_ok=True)
        build_engine(model, engine, options)
        stamp.write_text(source)
    return engine


@pytest.fixture(scope="session")
def tiny_gemma3_vlm_dir(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 vision-language checkpoint (tests/gemma3_vision_fixtures.py)."""
    from gemma3_vision_fixtures import make_tiny_gemma3_vlm

    return make_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"))


@pytest.fixture(scope="session")
def tiny_gemma3_vlm_engine(tmp_path_factory, tiny_gemma3_vlm_dir) -> Path:
    """The tiny Gemma 3 VLM built into a vision-language engine dir (fp32 weights and KV cache, block size 16)."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    out = tmp_path_factory.mktemp("tiny-gemma3-vlm-engine") / "engine"
    build_engine(tiny_gemma3_vlm_dir, out, BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return out
