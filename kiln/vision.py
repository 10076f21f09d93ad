"""The image side of a vision-language engine: what the manifest's "vision" object says, and the encoder
graph's contract.

A vision-language engine directory holds, besides the text graph:

  vision.onnx (+ .data)       the vision encoder + projector:
                                pixel_values    float32 [num_images, 3, image_size, image_size]
                                -> image_embeds float32 [num_images, tokens_per_image, embedding_size]
                              (an "image" here is one encoder input: an Idefics3 picture is several tiles)
  preprocessor_config.json    the checkpoint's image processor (kiln.runtime.vision.preprocess reads it)

and its text graph takes two more inputs, which put image embeddings in place of the token embeddings of
the image-placeholder rows (the rest of the graph, kiln.PagedAttention included, is the text model's own):

  image_embeds   float32 [num_image_rows, embedding_size]
  image_rows     int64   [num_image_rows]    rows of the packed batch that take them (zero rows: a text step)

A prompt holds one ``image_token_id`` per picture; the runtime expands it the family's way: "llava" into
``tokens_per_image`` image tokens; "idefics3" (Idefics3 and SmolVLM) into one run of ``tokens_per_image`` image
tokens per tile among tile-marker tokens (kiln.runtime.vision.idefics3); "llava_next" (LLaVA-NeXT) into one run
whose length depends on the image's size: its tiles' ``tokens_per_image`` rows each, packed and unpadded with a
newline row per feature row (kiln.runtime.vision.llava_next); "gemma3": its placeholder is ``<start_of_image>``
(``image_token_id`` names it), which becomes ``\n\n<start_of_image>`` + ``tokens_per_image`` ``<image_soft_token>``
+ ``<end_of_image>\n\n`` (kiln.runtime.vision.gemma3), and the text graph then has one more input, ``attend_until``
int32 [num_tokens] (kiln/paged_attention.py), so that an image's tokens see each other. A "llava_next" encoder graph
has a second output, ``image_newline`` float32 [embedding_size], the learned row separator that packing appends.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kiln.errors import parse_choice

ENCODER_GRAPH = "vision.onnx"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
PIXEL_VALUES = "pixel_values"
ENCODER_OUTPUT = "image_embeds"
IMAGE_EMBEDS = "image_embeds"
IMAGE_ROWS = "image_rows"
IMAGE_NEWLINE = "image_newline"  # the llava_next encoder graph's second output
FAMILIES = ("llava", "idefics3", "llava_next", "gemma3")
# what a chat message's image part becomes in the text the chat template renders: the image token, then this
# (LLaVA-1.5's prompts put the image on its own line; SmolVLM's and Gemma 3's chat templates write it inline)
PLACEHOLDER_SUFFIX = {"llava": "\n", "idefics3": "", "llava_next": "\n", "gemma3": ""}


class EncoderQuantization(Enum):
    """The encoder graph's linear layers (attention, MLP, projector; ``kiln build --vision-quantization``, the
    manifest's build.vision_quantization), compiled by optimize/vision_encoder.py with the text graph's passes:

      float32           as exported
      int8              int8 weights per output channel, activations int8 per token (the W8A8 pass:
                        MatMulIntegerToFloat); a quarter of the bytes and faster than float32 at an image's rows
      int8-weight-only  int8 weights per output channel in MatMulNBits (the int8 weight-only pass), whose kernel
                        quantizes activations per block of 128 inputs: finer activation scales than per token,
                        but slower than float32 at an image's rows on AVX2 CPUs

    The patch convolution, norms and position embeddings stay float32 under every one."""

    FLOAT32 = "float32"
    INT8 = "int8"
    INT8_WEIGHT_ONLY = "int8-weight-only"

    @classmethod
    def parse(cls, name: str) -> EncoderQuantization:
        return parse_choice(cls, name, "vision encoder quantization", "vision_quantization")


@dataclass(frozen=True)
class VisionSpec:
    """The manifest's "vision" object: which family's image layout, and the files and sizes the runtime needs."""

    family: str
    image_token_id: int
    tokens_per_image: int
    embedding_size: int
    image_size: int
    encoder: str = ENCODER_GRAPH
    preprocessor: str = PREPROCESSOR_CONFIG

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"vision family {self.family!r} is not one of {list(FAMILIES)}")
        for name in ("image_token_id", "tokens_per_image", "embedding_size", "image_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "image_token_id" else 1):
                raise ValueError(f"vision {name} must be a {'non-negative' if name == 'image_token_id' else 'positive'}"
                                 f" integer, got {value!r}")

    def placeholder(self, image_token: str) -> str:
        """The text one image part of a chat message becomes."""
        return image_token + PLACEHOLDER_SUFFIX[self.family]

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "image_token_id": self.image_token_id,
                "tokens_per_image": self.tokens_per_image, "embedding_size": self.embedding_size,
                "image_size": self.image_size, "encoder": self.encoder, "preprocessor": self.preprocessor}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionSpec:
        return cls(**data)
