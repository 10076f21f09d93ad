"""The vision encoder graph of a vision-language checkpoint: vision.onnx (+ .data) and preprocessor_config.json.

``load_vision(folder)`` reads the image side of a LlavaForConditionalGeneration checkpoint (CLIP tower,
export/vision/clip_encoder.py), a LlavaNextForConditionalGeneration one (the same per tile, and the newline vector:
export/vision/llava_next_encoder.py), an Idefics3 / SmolVLM one (SigLIP tower + pixel-shuffle connector,
export/vision/siglip_encoder.py) or a Gemma 3 one (SigLIP tower + pooling projector, export/vision/gemma3_encoder.py);
None for a text-only source. ``export_encoder(source)`` traces the family's module with a dynamic image (tile)
count (kiln/vision.py fixes the graph's inputs and outputs); ``write_vision(source, engine_dir, graph)`` writes
that graph, once optimized (optimize/vision_encoder.py), and the image processor's config beside the text graph.
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
from . import gemma3_config, gemma3_encoder, idefics3_config, llava_config, llava_next_config, siglip_encoder
from .clip_encoder import ClipVisionEncoder, encoder_weights
from .gemma3_config import Gemma3TowerSpec
from .idefics3_config import SiglipTowerSpec
from .llava_config import ClipTowerSpec
from .llava_next_encoder import LlavaNextVisionEncoder

_PROCESSOR_KEYS = ("image_processor_type", "size", "crop_size", "resample", "rescale_factor", "image_mean",
                   "image_std", "do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize",
                   "max_image_size", "do_image_splitting", "image_grid_pinpoints", "do_pan_and_scan")
_PROCESSORS = {"llava": ("CLIPImageProcessor",), "idefics3": ("Idefics3ImageProcessor", "SmolVLMImageProcessor"),
               "llava_next": ("LlavaNextImageProcessor",), "gemma3": ("Gemma3ImageProcessor",)}


@dataclass(frozen=True, eq=False)
class VisionSource:
    """A checkpoint's image side: the tower as compiled, its weights, the image processor and the manifest's spec."""

    tower: ClipTowerSpec | SiglipTowerSpec | Gemma3TowerSpec
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
    return load_vision(folder, config, read_safetensors(folder)) if _family(config) else None


def _family(config: dict[str, Any]) -> str | None:
    if llava_next_config.is_llava_next(config):
        return "llava_next"
    if llava_config.is_llava(config):
        return "llava"
    if gemma3_config.is_gemma3(config):
        return "gemma3"
    return "idefics3" if idefics3_config.is_idefics3(config) else None


def load_vision(folder: Path, config: dict[str, Any], weights: LazyWeights) -> VisionSource | None:
    """The image side of a Hugging Face checkpoint directory (config.json read as `config`), or None when the
    checkpoint is text-only."""
    family = _family(config)
    if family is None:
        return None
    processor_path = folder / contract.PREPROCESSOR_CONFIG
    if family == "gemma3" and not processor_path.is_file():
        return None  # a Gemma 3 checkpoint without its image processor builds its text part, as kiln always did
    if not processor_path.is_file():
        raise FileNotFoundError(f"{processor_path}: missing (a {family} checkpoint needs its image processor's "
                                "config)")
    processor = json.loads(processor_path.read_text(encoding="utf-8"))
    accepted = _PROCESSORS[family]
    kind = processor.get("image_processor_type", accepted[0])
    if kind.removesuffix("Fast").removesuffix("Pil") not in accepted:
        raise ValueError(f"{processor_path}: image processor {kind!r}; kiln preprocesses a {family} checkpoint's "
                         f"images the way of {' / '.join(accepted)}")
    try:
        return _family_source(family, config, processor, weights)
    except ValueError as exc:  # a config the family's export cannot take, named with its checkpoint
        raise ValueError(f"{folder}: {exc}") from None


def _family_source(family: str, config: dict[str, Any], processor: dict[str, Any],
                   weights: LazyWeights) -> VisionSource:
    if family == "llava":
        clip = llava_config.clip_tower_spec(config)
        return VisionSource(tower=clip, weights=llava_config.vision_part(weights), processor=processor,
                            spec=_vision_spec("llava", config, clip))
    if family == "llava_next":
        clip = llava_config.clip_tower_spec(config)
        llava_next_config.check_any_resolution(config, processor, clip)
        return VisionSource(tower=clip, weights=llava_next_config.vision_part(weights), processor=processor,
                            spec=_vision_spec("llava_next", config, clip))
    if family == "gemma3":
        gemma3 = gemma3_config.gemma3_tower_spec(config, processor)
        return VisionSource(tower=gemma3, weights=gemma3_config.vision_part(weights), processor=processor,
                            spec=_vision_spec("gemma3", config, gemma3))
    siglip = idefics3_config.siglip_tower_spec(config, processor)
    return VisionSource(tower=siglip, weights=idefics3_config.vision_part(weights), processor=processor,
                        spec=_vision_spec("idefics3", config, siglip))


def _vision_spec(family: str, config: dict[str, Any],
                 tower: ClipTowerSpec | SiglipTowerSpec | Gemma3TowerSpec) -> VisionSpec:
    # Gemma 3's prompts hold <start_of_image>, which its processor expands around the image tokens
    token = config.get("boi_token_index") if family == "gemma3" else config.get("image_token_id",
                                                                                  config.get("image_token_index"))
    if not isinstance(token, int):
        name = "boi_token_index" if family == "gemma3" else "image_token_id"
        raise ValueError(f"a {family} config without an integer {name} (got {token!r})")
    return VisionSpec(family=family, image_token_id=token, tokens_per_image=tower.tokens_per_image,
                      embedding_size=tower.text_hidden_size, image_size=tower.image_size)


def _encoder_module(source: VisionSource) -> torch.nn.Module:
    if isinstance(source.tower, Gemma3TowerSpec):
        return gemma3_encoder.Gemma3VisionEncoder(source.tower, gemma3_encoder.encoder_weights(source.weights))
    if isinstance(source.tower, SiglipTowerSpec):
        return siglip_encoder.SiglipVisionEncoder(source.tower, siglip_encoder.encoder_weights(source.weights))
    if source.spec.family == "llava_next":
        return LlavaNextVisionEncoder(source.tower, encoder_weights(source.tower, source.weights))
    return ClipVisionEncoder(source.tower, encoder_weights(source.tower, source.weights))


def _output_names(family: str) -> list[str]:
    return [contract.ENCODER_OUTPUT] + ([contract.IMAGE_NEWLINE] if family == "llava_next" else [])


def export_encoder(source: VisionSource) -> ir.Model:
    """The encoder graph in memory: pixel_values [N, 3, S, S] -> image_embeds [N, tokens, hidden]."""
    model = _encoder_module(source)
    size = source.tower.image_size
    example = torch.zeros((2, source.tower.num_channels, size, size), dtype=torch.float32)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    # LLaVA-NeXT's image_newline output is an initializer, which the exporter's deduplication warns it skips
    logging.getLogger("onnx_ir.passes.common.initializer_deduplication").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), redirect_stdout(StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), input_names=[contract.PIXEL_VALUES], output_names=_output_names(source.spec.family),
            dynamic_shapes={"pixel_values": {0: torch.export.Dim("images", min=1)}}, dynamo=True, optimize=True,
        )
    return program.model


def write_vision(source: VisionSource, engine_dir: Path, encoder: ir.Model) -> list[str]:
    """Write the encoder graph (export_encoder's, as the optimizer left it) and the processor config into
    engine_dir; the names written."""
    graph = engine_dir / source.spec.encoder
    data = graph.with_name(graph.name + ".data")
    ir.save(encoder, graph, external_data=data.name)
    processor = {key: source.processor[key] for key in _PROCESSOR_KEYS if key in source.processor}
    (engine_dir / source.spec.preprocessor).write_text(json.dumps(processor, indent=2, sort_keys=True))
    return [graph.name, data.name, source.spec.preprocessor]
