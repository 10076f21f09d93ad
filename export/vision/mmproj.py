"""llama.cpp's LLaVA-1.5 split: a text GGUF and an ``mmproj`` GGUF holding the CLIP tower and the projector.

    kiln build llava-v1.5-7b.gguf --mmproj mmproj-model-f16.gguf -o engines/llava

``load_mmproj(path, text)`` reads the mmproj into the VisionSource a Hugging Face LLaVA checkpoint gives
(export/vision/export_encoder.py), so the same encoder module, graph export and manifest follow. The file is what
llama.cpp's ``tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py --llava-projector`` writes (the documented
LLaVA-1.5 path): architecture ``clip``, projector type ``mlp``, metadata ``clip.vision.*`` (image and patch size,
widths, heads, norm epsilon, the layer count, image mean and std), tensors ``v.*`` (CLIP, names as
``clip-impl.h``'s) and ``mm.0`` / ``mm.2`` (the projector's two linears).

What the file leaves to the reader, settled here as LLaVA-1.5 and transformers have it:

- **Layers.** The converter drops the tower's last layer and writes ``block_count`` = the layers kept (or keeps
  ``clip.vision.feature_layer``'s deepest); every stored layer is computed, which is transformers'
  ``vision_feature_layer`` -2. llama.cpp's own LLaVA graph runs one layer fewer (a known bug there).
- **MLP names.** The legacy converter wrote CLIP's fc1 as ``ffn_down`` and fc2 as ``ffn_up``; newer converters
  write them the other way. As ``clip.cpp`` does, the pair is swapped when ``ffn_down`` takes the tower's width as
  its input.
- **Activations.** ``clip.use_gelu`` picks GELU over CLIP's quick GELU; the projector's is erf GELU, LLaVA's
  ``projector_hidden_act`` (llama.cpp evaluates ggml's tanh approximation of it).
- **Images.** CLIP's image processor at the file's size, mean and std (shortest-edge bicubic resize, center
  crop), as llava-hf's preprocessor_config.json has it; the CLS row is dropped.
- **The image token** is ``<image>`` from the text GGUF's own vocabulary (a llava-hf conversion has it); a text
  model without one is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kiln.vision import VisionSpec

from ..checkpoint_types import Checkpoint, LazyWeights, TensorSource
from ..gguf_loader import _metadata, _open, _tensor_sources
from .export_encoder import VisionSource
from .llava_config import ClipTowerSpec

IMAGE_TOKEN = "<image>"
_LAYER = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.class_embd": "tower.embeddings.class_embedding",
           "v.patch_embd.weight": "tower.embeddings.patch_embedding.weight",
           "v.position_embd.weight": "tower.embeddings.position_embedding.weight",
           "v.pre_ln.weight": "tower.pre_layrnorm.weight", "v.pre_ln.bias": "tower.pre_layrnorm.bias",
           "mm.0.weight": "projector.linear_1.weight", "mm.0.bias": "projector.linear_1.bias",
           "mm.2.weight": "projector.linear_2.weight", "mm.2.bias": "projector.linear_2.bias"}


class MmprojError(ValueError):
    """The mmproj file is not a LLaVA-1.5 image encoder kiln compiles, or does not fit the text model."""


def load_mmproj(path: str | Path, text: Checkpoint) -> VisionSource:
    """The image side of a LLaVA-1.5 engine from llama.cpp's mmproj file at ``path``, for the text model ``text``."""
    path = Path(path)
    reader = _open(path)
    md = _metadata(reader, path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    sources = _tensor_sources(reader, path, shapes)
    del reader
    _check_kind(md, path)
    tower = _tower_spec(md, shapes, text.spec.hidden_size, path)
    weights = _hf_names(sources, tower, path)
    mean, std = _floats(md, "clip.vision.image_mean", path), _floats(md, "clip.vision.image_std", path)
    size = tower.image_size
    processor = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": size},
                 "crop_size": {"height": size, "width": size}, "resample": 3, "rescale_factor": 1 / 255,
                 "image_mean": list(mean), "image_std": list(std), "do_convert_rgb": True, "do_resize": True,
                 "do_center_crop": True, "do_rescale": True, "do_normalize": True}
    spec = VisionSpec(family="llava", image_token_id=_image_token_id(text, path),
                      tokens_per_image=tower.tokens_per_image, embedding_size=tower.text_hidden_size, image_size=size)
    return VisionSource(tower=tower, weights=weights, processor=processor, spec=spec)


def _check_kind(md: dict[str, Any], path: Path) -> None:
    architecture = md.get("general.architecture")
    if architecture != "clip":
        raise MmprojError(f"{path}: general.architecture is {architecture!r}, not 'clip': not an mmproj file (the "
                          "text model goes first, the mmproj after --mmproj)")
    if not md.get("clip.has_vision_encoder", False):
        raise MmprojError(f"{path}: an mmproj without a vision encoder (clip.has_vision_encoder is not set)")
    projector = md.get("clip.projector_type", md.get("clip.vision.projector_type", "mlp"))
    if projector != "mlp":
        raise MmprojError(f"{path}: projector type {projector!r}; kiln compiles LLaVA-1.5's 'mlp' projector only")
    if "clip.vision.image_grid_pinpoints" in md or md.get("clip.vision.mm_patch_merge_type") == "spatial_unpad":
        raise MmprojError(f"{path}: a LLaVA-NeXT mmproj (any-resolution tiles); kiln compiles LLaVA-1.5's from GGUF")
    if md.get("clip.use_silu", False):
        raise MmprojError(f"{path}: clip.use_silu is set; a CLIP tower with SiLU is not LLaVA-1.5's")


def _int(md: dict[str, Any], key: str, path: Path) -> int:
    value = md.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MmprojError(f"{path}: metadata {key} must be a positive integer, got {value!r}")
    return value


def _floats(md: dict[str, Any], key: str, path: Path) -> tuple[float, float, float]:
    value = md.get(key)
    if not isinstance(value, list) or len(value) != 3:
        raise MmprojError(f"{path}: metadata {key} must be 3 numbers (RGB), got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def _tower_spec(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], text_hidden: int, path: Path) -> ClipTowerSpec:
    stored = _int(md, "clip.vision.block_count", path)
    feature = md.get("clip.vision.feature_layer")
    if feature is None:
        layers = stored
    elif isinstance(feature, list) and len(feature) == 1 and isinstance(feature[0], int) and 0 <= feature[0] <= stored:
        layers = feature[0]  # hidden_states[i], 0 the embeddings: the output of layer i - 1
    else:
        raise MmprojError(f"{path}: clip.vision.feature_layer {feature!r}; kiln reads one feature layer within the "
                          f"{stored} stored layers")
    missing = [i for i in range(layers) if f"v.blk.{i}.attn_q.weight" not in shapes]
    if missing:
        raise MmprojError(f"{path}: layers {missing} are missing (block_count {stored})")
    for name in ("v.patch_embd.weight", "v.position_embd.weight", "mm.0.weight", "mm.2.weight"):
        if name not in shapes:
            raise MmprojError(f"{path}: tensor {name} is missing")
    hidden, image, patch = (_int(md, f"clip.vision.{key}", path)
                            for key in ("embedding_length", "image_size", "patch_size"))
    positions = (image // patch) ** 2 + 1
    if shapes["v.position_embd.weight"] != (positions, hidden):
        raise MmprojError(f"{path}: v.position_embd.weight is {list(shapes['v.position_embd.weight'])}, not the "
                          f"{positions} positions x {hidden} of {image} px images in {patch} px patches")
    if shapes["mm.0.weight"][1] != hidden:
        raise MmprojError(f"{path}: mm.0.weight takes {shapes['mm.0.weight'][1]} inputs, the tower is {hidden} wide")
    if shapes["mm.2.weight"][0] != text_hidden:
        raise MmprojError(f"{path}: the projector writes {shapes['mm.2.weight'][0]}-wide embeddings, the text "
                          f"model's hidden size is {text_hidden}: not this model's mmproj")
    return ClipTowerSpec(
        hidden_size=hidden, intermediate_size=_int(md, "clip.vision.feed_forward_length", path),
        num_heads=_int(md, "clip.vision.attention.head_count", path), num_layers=layers, image_size=image,
        patch_size=patch, num_channels=shapes["v.patch_embd.weight"][1],
        layer_norm_eps=float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-5)),
        hidden_act="gelu" if md.get("clip.use_gelu", False) else "quick_gelu", drop_cls=True,
        projector_act="gelu", projector_bias="mm.0.bias" in shapes, text_hidden_size=text_hidden,
    )


def _hf_names(sources: dict[str, TensorSource], tower: ClipTowerSpec, path: Path) -> LazyWeights:
    """The tensors under ClipVisionEncoder's names (transformers' CLIPVisionTransformer's under ``tower.``); the
    layers past the feature layer left out, anything else unknown refused by name."""
    kept: dict[str, TensorSource] = {}
    for name, source in sources.items():
        if name in _GLOBAL:
            kept[_GLOBAL[name]] = source
            continue
        match = _LAYER.match(name)
        if match is None or match[2] not in _LAYER_PARTS:
            raise MmprojError(f"{path}: tensor {name} is not part of LLaVA-1.5's CLIP tower and projector")
        layer = int(match[1])
        if layer < tower.num_layers:
            kept[f"tower.encoder.layers.{layer}.{_LAYER_PARTS[match[2]]}.{match[3]}"] = source
    for layer in range(tower.num_layers):
        prefix = f"tower.encoder.layers.{layer}.mlp."
        if kept[prefix + "fc2.weight"].shape[1] == tower.hidden_size:  # the legacy names: ffn_down holds fc1
            for kind in ("weight", "bias"):
                kept[prefix + f"fc1.{kind}"], kept[prefix + f"fc2.{kind}"] = (kept[prefix + f"fc2.{kind}"],
                                                                              kept[prefix + f"fc1.{kind}"])
    return LazyWeights(kept)


def _image_token_id(text: Checkpoint, path: Path) -> int:
    from tokenizers import Tokenizer

    token_id = None
    if text.tokenizer is not None:
        token_id = Tokenizer.from_str(text.tokenizer.tokenizer_json).token_to_id(IMAGE_TOKEN)
    if token_id is None or token_id >= text.spec.vocab_size:
        raise MmprojError(f"{path}: the text model's vocabulary has no {IMAGE_TOKEN} token for the image to take "
                          "the place of (a llava-hf conversion has one; the original LLaVA-1.5 vocabulary does not)")
    return int(token_id)
