"""The vision encoder graph at run time: images -> preprocessed pixel values -> image embeddings.

The family (kiln/vision.py) decides how an image becomes encoder inputs and prompt tokens: LLaVA one CLIP crop
(runtime/vision/preprocess.py) and one run of image tokens; Idefics3 / SmolVLM several tiles
(runtime/vision/idefics3.py), their embeddings concatenated tile after tile, laid out among tile markers;
LLaVA-NeXT a base image and a grid of tiles (runtime/vision/llava_next.py), their embeddings packed into one run
whose length follows the image's size, with the newline vector the encoder graph holds (read once at load); Gemma 3
one square resize (runtime/vision/gemma3.py) and one bidirectional run between <start_of_image> and <end_of_image>.

One ONNX Runtime session of the engine's vision.onnx (kiln/vision.py). Embeddings are cached by the image's
content hash (sha256 of its decoded pixels and mode), least recently used out first once they pass
``cache_bytes`` (256 MiB: 27 images of LLaVA-1.5-7B's 576 x 4096 float32 embeddings), so an image sent again
(the same picture in a follow-up turn, or in several requests) is not encoded again; ``images_encoded`` counts
encoder runs per image, which /metrics exports.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from kiln import vision as contract
from kiln.manifest import EngineLoadError
from kiln.runtime.vision import gemma3, idefics3, llava_next
from kiln.runtime.vision.preprocess import ClipImageConfig, preprocess
from kiln.runtime.vision.prompt import ImageLayout, image_hash
from kiln.vision import VisionSpec

if TYPE_CHECKING:
    from PIL.Image import Image

Embeddings = npt.NDArray[np.float32]  # [tiles * tokens_per_image, hidden] (LLaVA-NeXT: its packed rows)
ImageConfig = (ClipImageConfig | idefics3.Idefics3ImageConfig | llava_next.LlavaNextImageConfig
               | gemma3.Gemma3ImageConfig)
_CONFIGS: dict[str, Callable[[dict[str, Any]], ImageConfig]] = {  # the family's image processor (else CLIP's)
    "idefics3": idefics3.Idefics3ImageConfig.from_hf, "llava_next": llava_next.LlavaNextImageConfig.from_hf,
    "gemma3": gemma3.Gemma3ImageConfig.from_hf}


class ImageEncoder:
    """encode(images) -> one [tokens_per_image, hidden] float32 array per image."""

    def __init__(self, engine_dir: Path, spec: VisionSpec, num_threads: int | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        self.spec = spec
        try:
            processor = json.loads((engine_dir / spec.preprocessor).read_text(encoding="utf-8"))
            self.preprocess_config: ImageConfig = _CONFIGS.get(spec.family, ClipImageConfig.from_hf)(processor)
        except (OSError, ValueError) as exc:
            raise EngineLoadError(f"the engine's image processor config {spec.preprocessor} is unusable "
                                  f"({exc})") from exc
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(engine_dir / spec.encoder), sess_options=options,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT raises several unrelated types
            raise EngineLoadError(f"onnxruntime cannot load the vision encoder {spec.encoder} ({exc})") from exc
        self.image_newline = self._image_newline() if spec.family == "llava_next" else None
        self.cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._cache: OrderedDict[str, Embeddings] = OrderedDict()
        self._lock = threading.Lock()  # the server encodes on worker threads
        self.images_encoded = 0
        self.cache_hits = 0
        self._prompt: idefics3.Idefics3Prompt | None = None
        self._gemma3_prompt: gemma3.Gemma3Prompt | None = None

    def _image_newline(self) -> npt.NDArray[np.float32]:
        """LLaVA-NeXT's learned row separator, the encoder graph's constant second output (a run on no image)."""
        size = self.spec.image_size
        try:
            newline = self.session.run([contract.IMAGE_NEWLINE],
                                       {contract.PIXEL_VALUES: np.zeros((0, 3, size, size), np.float32)})[0]
        except Exception as exc:  # noqa: BLE001 - ORT raises several unrelated types
            raise EngineLoadError(f"the vision encoder {self.spec.encoder} has no usable {contract.IMAGE_NEWLINE} "
                                  f"output ({exc})") from exc
        if np.shape(newline) != (self.spec.embedding_size,):
            raise EngineLoadError(f"the vision encoder's {contract.IMAGE_NEWLINE} has shape {np.shape(newline)}, not "
                                  f"[{self.spec.embedding_size}]")
        return np.asarray(newline, dtype=np.float32)

    def tiles(self, image: Image) -> tuple[npt.NDArray[np.float32], int, int]:
        """(one image's encoder inputs [tiles, 3, S, S], rows, cols of its tile grid: 0, 0 when not split)."""
        config = self.preprocess_config
        if isinstance(config, idefics3.Idefics3ImageConfig):
            return idefics3.pixel_values(image, config)
        if isinstance(config, llava_next.LlavaNextImageConfig):
            return llava_next.pixel_values(image, config), *llava_next.grid(image.height, image.width, config)
        if isinstance(config, gemma3.Gemma3ImageConfig):
            return gemma3.pixel_values(image, config)[None], 0, 0
        return preprocess(image, config)[None], 0, 0

    def pixel_values(self, images: list[Image]) -> npt.NDArray[np.float32]:
        """[tiles of all images, 3, S, S] float32, as the encoder graph takes them."""
        return np.concatenate([self.tiles(image)[0] for image in images])

    def layouts(self, images: list[Image], tokenizer: idefics3._Tokenizer) -> list[ImageLayout] | None:
        """The prompt tokens each image's placeholder expands to (None: the family's one run of image tokens)."""
        config = self.preprocess_config
        if isinstance(config, llava_next.LlavaNextImageConfig):  # one run, its length from the image's size
            return [ImageLayout.one_run(self.spec.image_token_id, llava_next.num_tokens(
                image.height, image.width, config, self.spec.tokens_per_image)) for image in images]
        if isinstance(config, gemma3.Gemma3ImageConfig):
            return [self.gemma3_prompt(tokenizer).layout()] * len(images)
        if not isinstance(config, idefics3.Idefics3ImageConfig):
            return None
        if self._prompt is None:
            self._prompt = idefics3.Idefics3Prompt(tokenizer, self.spec.image_token_id, self.spec.tokens_per_image)
        grids = [idefics3.grid(image.height, image.width, config) for image in images]
        return [self._prompt.layout(rows, cols) for rows, cols in grids]

    def gemma3_prompt(self, tokenizer: gemma3._Tokenizer) -> gemma3.Gemma3Prompt:
        """Gemma 3's layout tokens, read from the engine's tokenizer once."""
        if self._gemma3_prompt is None:
            self._gemma3_prompt = gemma3.Gemma3Prompt(tokenizer, self.spec.image_token_id, self.spec.tokens_per_image)
        return self._gemma3_prompt

    def run(self, pixel_values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The encoder graph on pixel values: [N, tokens_per_image, hidden]."""
        result = self.session.run([contract.ENCODER_OUTPUT], {contract.PIXEL_VALUES: pixel_values})[0]
        return np.asarray(result, dtype=np.float32)

    def _rows(self, tiles: npt.NDArray[np.float32], image: Image) -> Embeddings:
        """One image's prompt rows from its tiles' embeddings [tiles, tokens_per_image, hidden]."""
        config = self.preprocess_config
        if isinstance(config, llava_next.LlavaNextImageConfig) and self.image_newline is not None:
            return llava_next.pack(tiles, image.height, image.width, config, self.image_newline)
        return tiles.reshape(-1, tiles.shape[-1])

    def encode(self, images: list[Image], hashes: list[str] | None = None) -> list[Embeddings]:
        """The embeddings of each image, from the cache where it holds them; the rest encoded in one run."""
        hashes = hashes or [image_hash(image) for image in images]
        with self._lock:
            found = {h: self._cache[h] for h in hashes if h in self._cache}
            for h in found:
                self._cache.move_to_end(h)
            self.cache_hits += sum(1 for h in hashes if h in found)
        todo = {h: image for h, image in zip(hashes, images, strict=True) if h not in found}
        if todo:
            inputs = [self.tiles(image)[0] for image in todo.values()]
            tiles = self.run(np.concatenate(inputs))
            ends = np.cumsum([len(x) for x in inputs])
            embeddings = [self._rows(t, image) for t, image in zip(np.split(tiles, ends[:-1]), todo.values(),
                                                                    strict=True)]
            with self._lock:
                self.images_encoded += len(todo)
                for h, embedding in zip(todo, embeddings, strict=True):
                    found[h] = embedding
                    if h not in self._cache:
                        self._cache[h] = embedding
                        self._cached_bytes += embedding.nbytes
                while self._cached_bytes > self.cache_bytes and self._cache:
                    self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return [found[h] for h in hashes]
