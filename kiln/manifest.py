"""The engine directory contract: manifest.json, written at build time, checked first at load.

Loading fails with one sentence for: no manifest, a manifest that does not fit its schema (the
field named), unknown format version, a missing, corrupted (sha256) or unlisted file, an
unavailable backend, or an op-library ABI mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from kiln import __version__
from kiln.contract import KV_DTYPES, OP_LIBRARY_ABI, OP_LIBRARY_MIN_ABI
from kiln.errors import InvalidParamError, KilnError, require
from kiln.medusa import MedusaSpec
from kiln.pipeline_stages import PipelineStage, check_stages
from kiln.quant_scheme import LmHead, QuantScheme
from kiln.spec import ModelSpec
from kiln.tensor_parallel import TensorRank, check_ranks
from kiln.verified_files import FileVerifier, sha256_file
from kiln.vision import EncoderQuantization, VisionSpec

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
    # a key of kiln.contract.KV_DTYPES; float16 halves what attention reads at fp32's measured perplexity
    kv_dtype: str = "float16"
    block_size: int = 16
    max_seq_len: int | None = None  # None: the model's own context (ModelSpec.context_length)
    max_num_tokens: int = 2048  # per-step token budget the graph was built and tested for
    calibration: Path | None = None  # artifact of `kiln calibrate`: scales folded in (SmoothQuant / AWQ), int8 KV steps
    lm_head: LmHead = LmHead.INT8  # the LM head's weights under an int4 scheme
    medusa: Path | None = None  # artifact of `kiln train-medusa`: heads compiled into the graph (kiln/medusa.py)
    pipeline_stages: int = 1  # graphs of contiguous layer ranges (kiln/pipeline_stages.py); 1: one graph
    tensor_parallel: int = 1  # graphs of each rank's heads and MLP columns (kiln/tensor_parallel.py); 1: one graph
    # a vision-language engine's encoder weights (kiln/vision.py); a text-only build takes only the default
    vision_quantization: EncoderQuantization = EncoderQuantization.FLOAT32

    def __post_init__(self) -> None:
        require(isinstance(self.quantization, QuantScheme), "quantization", "a QuantScheme (QuantScheme.parse(name))",
                self.quantization)
        require(self.kv_dtype in KV_DTYPES, "kv_dtype", f"one of {list(KV_DTYPES)}", self.kv_dtype)
        for name in ("block_size", "max_seq_len", "max_num_tokens", "pipeline_stages", "tensor_parallel"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0 or name == "max_seq_len" and value is None, name,
                    "a positive integer", value)
        require(self.calibration is None or isinstance(self.calibration, Path), "calibration", "a Path or None",
                self.calibration)
        require(isinstance(self.lm_head, LmHead), "lm_head", "an LmHead (LmHead.parse(name))", self.lm_head)
        require(self.medusa is None or isinstance(self.medusa, Path), "medusa", "a Path or None", self.medusa)
        require(isinstance(self.vision_quantization, EncoderQuantization), "vision_quantization",
                "an EncoderQuantization (EncoderQuantization.parse(name))", self.vision_quantization)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "build" object: the scheme by name, the artifact as a path string or null. The optional
        fields are written only when they differ from what their absence means, so an engine that uses none of
        them stays readable by a kiln that predates them (a reader refuses unknown fields)."""
        data: dict[str, Any] = {
            "quantization": self.quantization.name, "kv_dtype": self.kv_dtype, "block_size": self.block_size,
            "max_seq_len": self.max_seq_len, "max_num_tokens": self.max_num_tokens,
            "calibration": None if self.calibration is None else str(self.calibration),
            "lm_head": self.lm_head.value, "medusa": None if self.medusa is None else str(self.medusa)}
        defaults = {declared.name: declared.default for declared in dataclasses.fields(self)}
        for name in ("pipeline_stages", "tensor_parallel", "vision_quantization"):
            if (value := getattr(self, name)) != defaults[name]:
                data[name] = value.value if isinstance(value, EncoderQuantization) else value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildOptions:
        """Read to_dict's object, and that of older manifests: they also carry "dtype" (always float32,
        the only one builds accepted) and "" for no calibration artifact, and lack "lm_head" (int8 then)
        "medusa" (no heads), "pipeline_stages" and "tensor_parallel" (one graph), "vision_quantization"
        (float32: every encoder was)."""
        fields = {key: value for key, value in data.items() if key != "dtype"}
        calibration = fields.pop("calibration", None)
        medusa = fields.pop("medusa", None)
        return cls(quantization=QuantScheme.parse(fields.pop("quantization", "none")),
                   calibration=Path(calibration) if calibration else None, medusa=Path(medusa) if medusa else None,
                   lm_head=LmHead.parse(fields.pop("lm_head", LmHead.INT8.value)),
                   vision_quantization=EncoderQuantization.parse(fields.pop("vision_quantization", "float32")),
                   **fields)


@dataclass(frozen=True)
class TensorRTPlan:
    """What a TensorRT engine's model.plan was built with: a plan runs only on this TensorRT version and GPU
    architecture (compute capability "major.minor"), which the TensorRT runner checks before deserializing."""

    version: str
    compute_capability: str

    def to_dict(self) -> dict[str, str]:
        return {"version": self.version, "compute_capability": self.compute_capability}


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
    tensorrt: TensorRTPlan | None = None  # backend "tensorrt" with its model.plan built; None: no plan (yet)
    # kiln build --pipeline-stages N (N > 1): one graph per layer range instead of model.onnx; () (and every
    # engine without the field): the one graph model.onnx (see `graph_files`)
    stages: tuple[PipelineStage, ...] = ()
    vision: VisionSpec | None = None  # a vision-language engine's image side (kiln/vision.py); None: text only
    # kiln build --tensor-parallel N (N > 1): one graph per rank instead of model.onnx; (): the one graph
    ranks: tuple[TensorRank, ...] = ()

    def __post_init__(self) -> None:
        require(self.build.max_seq_len is not None, "build.max_seq_len",
                "set in a manifest (the build resolves the model's default)", None)
        try:
            check_stages(self.stages, self.spec.num_layers)
        except ValueError as exc:
            raise EngineLoadError(f"{MANIFEST_NAME} field stages is inconsistent: {exc}") from None
        if self.stages and len(self.stages) != self.build.pipeline_stages:
            raise EngineLoadError(f"{MANIFEST_NAME} lists {len(self.stages)} stages, but build.pipeline_stages is "
                                  f"{self.build.pipeline_stages}")
        if len(self.stages) == 1:
            raise EngineLoadError(f"{MANIFEST_NAME} field stages lists one stage; a one-stage engine has model.onnx "
                                  "and no stages")
        try:
            check_ranks(self.ranks, self.spec.num_heads, self.spec.num_kv_heads)
        except ValueError as exc:
            raise EngineLoadError(f"{MANIFEST_NAME} field ranks is inconsistent: {exc}") from None
        if len(self.ranks) != (self.build.tensor_parallel if self.build.tensor_parallel > 1 else 0):
            raise EngineLoadError(f"{MANIFEST_NAME} lists {len(self.ranks)} tensor-parallel ranks, but "
                                  f"build.tensor_parallel is {self.build.tensor_parallel}")
        if self.ranks and self.stages:
            raise EngineLoadError(f"{MANIFEST_NAME} lists both pipeline stages and tensor-parallel ranks")

    @property
    def graph_files(self) -> tuple[str, ...]:
        """The engine's graphs: its stages' or ranks' in order, or model.onnx."""
        return (tuple(stage.graph for stage in self.stages) or tuple(rank.graph for rank in self.ranks)
                or ("model.onnx",))

    @property
    def max_seq_len(self) -> int:
        """The context the engine was built for (a manifest always holds it; see __post_init__)."""
        assert self.build.max_seq_len is not None
        return self.build.max_seq_len

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "format_version": self.format_version,
            "kiln_version": self.kiln_version,
            "backend": self.backend,
            "op_library_abi": self.op_library_abi,
            "model_spec": self.spec.to_dict(),
            "build": self.build.to_dict(),
            "graph": {"inputs": list(self.graph_inputs), "outputs": list(self.graph_outputs)},
            "files": self.files,
            "medusa": None if self.medusa is None else self.medusa.to_dict(),
            "tensorrt": None if self.tensorrt is None else self.tensorrt.to_dict(),
        }
        if self.stages:  # only staged engines carry the field: a one-graph manifest reads as before
            data["stages"] = [stage.to_dict() for stage in self.stages]
        if self.ranks:
            data["ranks"] = [rank.to_dict() for rank in self.ranks]
        if self.vision is not None:  # a text engine's manifest stays as kiln before vision wrote it
            data["vision"] = self.vision.to_dict()
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse manifest.json: its schema first (one sentence naming the first field that does not fit),
        then the values each type checks itself."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineLoadError(f"{MANIFEST_NAME} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise EngineLoadError(f"{MANIFEST_NAME} must be a JSON object, got {_json_type(data)}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineLoadError(
                f"engine format version {version!r} is not supported by this kiln "
                f"(it reads version {FORMAT_VERSION}); rebuild the engine with kiln {__version__}"
            )
        _check_schema(data, _SCHEMA, "")
        try:
            spec = ModelSpec.from_dict(data["model_spec"])
        except ValueError as exc:
            raise EngineLoadError(f"{MANIFEST_NAME} field model_spec is inconsistent: {exc}") from None
        try:
            build = BuildOptions.from_dict(data["build"])
        except InvalidParamError as exc:
            raise EngineLoadError(f"{MANIFEST_NAME} field build.{exc.param} is invalid: {exc}") from None
        return cls(
            spec=spec,
            build=build,
            backend=data["backend"],
            graph_inputs=tuple(data["graph"]["inputs"]),
            graph_outputs=tuple(data["graph"]["outputs"]),
            files=dict(data["files"]),
            format_version=version,
            kiln_version=data["kiln_version"],
            op_library_abi=data["op_library_abi"],
            medusa=MedusaSpec.from_dict(data["medusa"]) if data.get("medusa") else None,
            tensorrt=TensorRTPlan(**data["tensorrt"]) if data.get("tensorrt") else None,
            stages=tuple(PipelineStage(**stage) for stage in data.get("stages", ())),
            vision=_vision(data.get("vision")),
            ranks=_ranks(data.get("ranks", ())),
        )


def _ranks(data: list[dict[str, Any]]) -> tuple[TensorRank, ...]:
    try:
        return tuple(TensorRank(**rank) for rank in data)
    except ValueError as exc:
        raise EngineLoadError(f"{MANIFEST_NAME} field ranks is inconsistent: {exc}") from None


def _vision(data: dict[str, Any] | None) -> VisionSpec | None:
    try:
        return None if data is None else VisionSpec.from_dict(data)
    except ValueError as exc:
        raise EngineLoadError(f"{MANIFEST_NAME} field vision is inconsistent: {exc}") from None


# manifest.json's schema: each field's type as Python annotates it, a nested dict for a JSON object
# ("?" ends an optional key); model_spec is ModelSpec's own fields, so the schema follows the dataclass.
# "dtype" (always float32) and a "" calibration are what builds before the typed options wrote.
_BUILD_SCHEMA: dict[str, Any] = {
    "quantization": str, "kv_dtype": str, "block_size": int, "max_seq_len": int, "max_num_tokens": int,
    "calibration?": str | None, "lm_head?": str, "dtype?": str, "medusa?": str | None,
    "pipeline_stages?": int, "tensor_parallel?": int, "vision_quantization?": str,
}
_SCHEMA: dict[str, Any] = {
    "format_version": int, "kiln_version": str, "backend": str, "op_library_abi": int,
    "model_spec": ModelSpec, "build": _BUILD_SCHEMA,
    "graph": {"inputs": list[str], "outputs": list[str]}, "files": dict[str, str],
    "medusa?": MedusaSpec | None, "tensorrt?": TensorRTPlan | None, "stages?": list[PipelineStage],
    "vision?": VisionSpec | None, "ranks?": list[TensorRank],
}
_RULES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _object_fields(schema: Any) -> dict[str, tuple[Any, bool]]:
    """key -> (type, required) of a dict schema or a dataclass."""
    if isinstance(schema, dict):
        return {key.rstrip("?"): (hint, not key.endswith("?")) for key, hint in schema.items()}
    hints = typing.get_type_hints(schema)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(schema)}


def _describe(schema: Any) -> str:
    origin = typing.get_origin(schema)
    if isinstance(schema, dict) or dataclasses.is_dataclass(schema) or origin is dict:
        return "an object"
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(schema)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(schema))
    return _RULES[schema]


def _fits(value: Any, schema: Any) -> bool:
    """Whether value has schema's JSON type at this level (bool is not a number; an int is a float)."""
    origin = typing.get_origin(schema)
    if isinstance(schema, dict) or dataclasses.is_dataclass(schema) or origin is dict:
        return isinstance(value, dict)
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin in (Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(schema))
    if schema in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if schema is float else schema)


def _check_schema(value: Any, schema: Any, where: str) -> None:
    """Raise EngineLoadError naming the first field of value (at path `where`) that does not fit schema."""
    if not _fits(value, schema):
        raise EngineLoadError(f"{MANIFEST_NAME} field {where} must be {_describe(schema)}, got {value!r}")
    origin = typing.get_origin(schema)
    if origin in (Union, types.UnionType):  # check inside the option the value fits (e.g. an object, not null)
        return _check_schema(value, next(o for o in typing.get_args(schema) if _fits(value, o)), where)
    prefix = f"{where}." if where else ""
    if isinstance(schema, dict) or dataclasses.is_dataclass(schema):
        fields = _object_fields(schema)
        for key in value:
            if key not in fields:
                raise EngineLoadError(f"{MANIFEST_NAME} has an unknown field {prefix}{key}")
        for key, (hint, required) in fields.items():
            if key in value:
                _check_schema(value[key], hint, prefix + key)
            elif required:
                raise EngineLoadError(f"{MANIFEST_NAME} lacks the field {prefix}{key}")
    elif origin is dict:
        for key, item in value.items():
            _check_schema(item, typing.get_args(schema)[1], f"{where}[{key!r}]")
    elif origin in (list, tuple):
        for index, item in enumerate(value):
            _check_schema(item, typing.get_args(schema)[0], f"{where}[{index}]")
    elif origin in (Union, types.UnionType):
        _check_schema(value, next(option for option in typing.get_args(schema) if _fits(value, option)), where)


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
    for name in manifest.files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise EngineLoadError(f"{MANIFEST_NAME} lists {name!r}, which is not a path inside the engine directory")
    for graph in manifest.graph_files:
        if manifest.files and graph not in manifest.files:
            raise EngineLoadError(f"{MANIFEST_NAME} lists no checksum for the engine graph {graph}; rebuild the engine")
    if verify_checksums:
        verifier = FileVerifier()  # a file unchanged since its sha256 last matched is not hashed again
        for name, expected in manifest.files.items():
            file = engine_dir / name
            if not file.is_file():
                raise EngineLoadError(f"engine file {name} is missing from {engine_dir}")
            if not verifier.matches(file, expected):
                raise EngineLoadError(f"engine file {name} is corrupted (sha256 does not match the manifest)")
        verifier.close()
        _refuse_unlisted_files(engine_dir, manifest)
    return manifest


def _refuse_unlisted_files(engine_dir: Path, manifest: Manifest) -> None:
    """Only checksummed files may be loaded, and ONNX Runtime reads whatever external-data file the graph
    names: so an engine directory holds exactly its manifest and the files the manifest checksums."""
    for path in sorted(engine_dir.rglob("*")):
        name = str(path.relative_to(engine_dir))
        if path.is_file() and name != MANIFEST_NAME and name not in manifest.files:
            raise EngineLoadError(f"engine file {name} is not checksummed by {MANIFEST_NAME} and kiln loads only "
                                  "checksummed engine files; remove it or rebuild the engine")
