"""The engine directory contract: manifest.json, written at build time, checked first at load.

Loading fails with one sentence for: no manifest, unknown format version, a missing or
corrupted file (sha256), an unavailable backend, or an op-library ABI mismatch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.contract import KV_DTYPES, OP_LIBRARY_ABI, OP_LIBRARY_MIN_ABI
from kiln.errors import KilnError, require
from kiln.medusa import MedusaSpec
from kiln.quant_scheme import LmHead, QuantScheme
from kiln.spec import ModelSpec

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
BACKEND_ORT_CPU = "onnxruntime-cpu"
BACKEND_TENSORRT = "tensorrt"




class EngineLoadError(KilnError, RuntimeError):
    """An engine directory that cannot be served; the message is one sentence naming why."""


@dataclass(frozen=True)
class BuildOptions:
    """What `kiln build` compiles for; each field checked alone here (the build checks how they pair).

    Unquantized matmuls and activations are float32: the one dtype the ORT CPU engine computes in.
    """

    quantization: QuantScheme = QuantScheme()
    kv_dtype: str = "float32"  # a key of kiln.contract.KV_DTYPES
    block_size: int = 16
    max_seq_len: int = 2048
    max_num_tokens: int = 2048  # per-step token budget the graph was built and tested for
    calibration: Path | None = None  # artifact of `kiln calibrate`: scales folded in (SmoothQuant / AWQ), int8 KV steps
    lm_head: LmHead = LmHead.INT8  # the LM head's weights under an int4 scheme
    medusa: Path | None = None  # artifact of `kiln train-medusa`: heads compiled into the graph (kiln/medusa.py)

    def __post_init__(self) -> None:
        require(isinstance(self.quantization, QuantScheme), "quantization", "a QuantScheme (QuantScheme.parse(name))",
                self.quantization)
        require(self.kv_dtype in KV_DTYPES, "kv_dtype", f"one of {list(KV_DTYPES)}", self.kv_dtype)
        for name in ("block_size", "max_seq_len", "max_num_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        require(self.calibration is None or isinstance(self.calibration, Path), "calibration", "a Path or None",
                self.calibration)
        require(isinstance(self.lm_head, LmHead), "lm_head", "an LmHead (LmHead.parse(name))", self.lm_head)
        require(self.medusa is None or isinstance(self.medusa, Path), "medusa", "a Path or None", self.medusa)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "build" object: the scheme by name, the artifact as a path string or null."""
        return {"quantization": self.quantization.name, "kv_dtype": self.kv_dtype, "block_size": self.block_size,
                "max_seq_len": self.max_seq_len, "max_num_tokens": self.max_num_tokens,
                "calibration": None if self.calibration is None else str(self.calibration),
                "lm_head": self.lm_head.value, "medusa": None if self.medusa is None else str(self.medusa)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildOptions:
        """Read to_dict's object, and that of older manifests: they also carry "dtype" (always float32,
        the only one builds accepted) and "" for no calibration artifact, and lack "lm_head" (int8 then)
        and "medusa" (no heads)."""
        fields = {key: value for key, value in data.items() if key != "dtype"}
        calibration = fields.pop("calibration", None)
        medusa = fields.pop("medusa", None)
        return cls(quantization=QuantScheme.parse(fields.pop("quantization", "none")),
                   calibration=Path(calibration) if calibration else None, medusa=Path(medusa) if medusa else None,
                   lm_head=LmHead.parse(fields.pop("lm_head", LmHead.INT8.value)), **fields)


@dataclass(frozen=True)
class Manifest:
    spec: ModelSpec
    build: BuildOptions
    backend: str
    graph_inputs: tuple[str, ...]
    graph_outputs: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    format_version: int = FORMAT_VERSION
    kiln_version: str = __version__
    op_library_abi: int = OP_LIBRARY_ABI
    medusa: MedusaSpec | None = None  # the Medusa heads in the graph; None (older engines too): none

    def to_json(self) -> str:
        data = {
            "format_version": self.format_version,
            "kiln_version": self.kiln_version,
            "backend": self.backend,
            "op_library_abi": self.op_library_abi,
            "model_spec": self.spec.to_dict(),
            "build": self.build.to_dict(),
            "graph": {"inputs": list(self.graph_inputs), "outputs": list(self.graph_outputs)},
            "files": self.files,
            "medusa": None if self.medusa is None else self.medusa.to_dict(),
        }
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineLoadError(
                f"engine format version {version!r} is not supported by this kiln "
                f"(it reads version {FORMAT_VERSION}); rebuild the engine with kiln {__version__}"
            )
        return cls(
            spec=ModelSpec.from_dict(data["model_spec"]),
            build=BuildOptions.from_dict(data["build"]),
            backend=data["backend"],
            graph_inputs=tuple(data["graph"]["inputs"]),
            graph_outputs=tuple(data["graph"]["outputs"]),
            files=dict(data["files"]),
            format_version=version,
            kiln_version=data["kiln_version"],
            op_library_abi=data["op_library_abi"],
            medusa=MedusaSpec.from_dict(data["medusa"]) if data.get("medusa") else None,
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(engine_dir: Path, manifest: Manifest) -> Manifest:
    """Checksum every file already in engine_dir and write manifest.json beside them."""
    engine_dir = Path(engine_dir)
    files = {
        str(p.relative_to(engine_dir)): sha256_file(p)
        for p in sorted(engine_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    final = Manifest(**{**manifest.__dict__, "files": files})
    (engine_dir / MANIFEST_NAME).write_text(final.to_json())
    return final


def read_manifest(engine_dir: Path, verify_checksums: bool = True) -> Manifest:
    """Read and check manifest.json; every problem is an EngineLoadError with one sentence."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST_NAME
    if not engine_dir.is_dir():
        raise EngineLoadError(f"engine directory {engine_dir} does not exist")
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} is not a kiln engine directory: it has no {MANIFEST_NAME}")
    try:
        manifest = Manifest.from_json(path.read_text())
    except (KeyError, TypeError, ValueError) as exc:  # json.JSONDecodeError and bad field values are ValueErrors
        raise EngineLoadError(f"{path} is malformed ({exc.__class__.__name__}: {exc})") from exc
    if not OP_LIBRARY_MIN_ABI <= manifest.op_library_abi <= OP_LIBRARY_ABI:
        raise EngineLoadError(
            f"engine was built for kiln op-library ABI {manifest.op_library_abi}, but this kiln "
            f"provides ABI {OP_LIBRARY_ABI} (and runs engines of ABI {OP_LIBRARY_MIN_ABI} to {OP_LIBRARY_ABI}); "
            "rebuild the engine"
        )
    if verify_checksums:
        for name, expected in manifest.files.items():
            file = engine_dir / name
            if not file.is_file():
                raise EngineLoadError(f"engine file {name} is missing from {engine_dir}")
            if sha256_file(file) != expected:
                raise EngineLoadError(f"engine file {name} is corrupted (sha256 does not match the manifest)")
    return manifest
