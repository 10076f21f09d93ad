"""The vision encoder graph of a vision-language checkpoint: vision.onnx (+ .data) and preprocessor_config.json.

``load_vision(folder)`` reads a LlavaForConditionalGeneration checkpoint's image side (None for a text-only
source); ``write_vision(source, engine_dir)`` traces export/vision/clip_encoder.py's module with a dynamic image
count and writes the graph (kiln/vision.py fixes its inputs and outputs) and the image processor's config
beside the text graph.
"""

from __future__ import annotations

import json
import logging
import warnings
from contextlib import redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from kiln import vision as contract
from kiln.vision import VisionSpec

from ..checkpoint_types import LazyWeights
from .clip_encoder import ClipVisionEncoder, encoder_weights
from .llava_config import ClipTowerSpec, clip_tower_spec, is_llava, vision_part, vision_spec

_PROCESSOR_KEYS = ("image_processor_type", "size", "crop_size", "resample", "rescale_factor", "image_mean",
                   "image_std", "do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize")


@dataclass(frozen=True, eq=False)
class VisionSource:
    """A checkpoint's image side: the tower as compiled, its weights, the image processor and the manifest's spec."""

    tower: ClipTowerSpec
    weights: LazyWeights
    processor: dict[str, Any]
    spec: VisionSpec


def load_vision_of(model_path: str | Path) -> VisionSource | None:
    """load_vision for a model source as `kiln build` takes it: a GGUF file (or "default") is text-only."""
    from ..checkpoint import read_safetensors

    folder = Path(model_path)
    if folder.name == "config.json":
        folder = folder.parent
    if not folder.is_dir() or not (folder / "config.json").is_file():
        return None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return load_vision(folder, config, read_safetensors(folder)) if is_llava(config) else None


def load_vision(folder: Path, config: dict[str, Any], weights: LazyWeights) -> VisionSource | None:
    """The image side of a Hugging Face checkpoint directory (config.json read as `config`), or None when the
    checkpoint is text-only."""
    if not is_llava(config):
        return None
    processor_path = folder / contract.PREPROCESSOR_CONFIG
    if not processor_path.is_file():
        raise FileNotFoundError(f"{processor_path}: missing (a LLaVA checkpoint needs its image processor's config)")
    processor = json.loads(processor_path.read_text(encoding="utf-8"))
    kind = processor.get("image_processor_type", "CLIPImageProcessor")
    if kind.removesuffix("Fast").removesuffix("Pil") != "CLIPImageProcessor":
        raise ValueError(f"{processor_path}: image processor {kind!r}; kiln preprocesses CLIPImageProcessor's way")
    tower = clip_tower_spec(config)
    return VisionSource(tower=tower, weights=vision_part(weights), processor=processor,
                        spec=vision_spec(config, tower))


def export_encoder(source: VisionSource) -> ir.Model:
    """The encoder graph in memory: pixel_values [N, 3, S, S] -> image_embeds [N, tokens, hidden]."""
    model = ClipVisionEncoder(source.tower, encoder_weights(source.tower, source.weights))
    size = source.tower.image_size
    example = torch.zeros((2, source.tower.num_channels, size, size), dtype=torch.float32)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), redirect_stdout(StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), input_names=[contract.PIXEL_VALUES], output_names=[contract.ENCODER_OUTPUT],
            dynamic_shapes={"pixel_values": {0: torch.export.Dim("images", min=1)}}, dynamo=True, optimize=True,
        )
    return program.model


def write_vision(source: VisionSource, engine_dir: Path) -> list[str]:
    """Write the encoder graph and the processor config into engine_dir; the names written."""
    graph = engine_dir / source.spec.encoder
    data = graph.with_name(graph.name + ".data")
    ir.save(export_encoder(source), graph, external_data=data.name)
    processor = {key: source.processor[key] for key in _PROCESSOR_KEYS if key in source.processor}
    (engine_dir / source.spec.preprocessor).write_text(json.dumps(processor, indent=2, sort_keys=True))
    return [graph.name, data.name, source.spec.preprocessor]
