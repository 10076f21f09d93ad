"""Images as requests carry them, decoded with limits: every refusal an InvalidParamError naming the problem.

An image arrives as a ``data:image/...;base64,`` URL (OpenAI's image_url content part), raw bytes, or an already
decoded Pillow image (the Python API); a ``file://`` URL when the operator allows a directory
(runtime/vision/local_media.py). http(s) URLs and plain paths are refused: the server fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import InvalidParamError
from kiln.runtime.vision.local_media import ALLOWED_MEDIA_FLAG, is_file_url, read_media_file

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_BYTES = 20 << 20  # an encoded image file
MAX_IMAGE_PIXELS = 40_000_000  # a decoded one (8K x 5K); Pillow's own bomb check stops at twice its default
MAX_IMAGES_PER_REQUEST = 8


def decode_image_url(url: object, param: str, media_dir: Path | None = None) -> Image:
    """A data URL's image, or a file URL's inside ``media_dir`` (None: file URLs refused); InvalidParamError
    for any other URL, bad base64, or bytes that are no image."""
    if not isinstance(url, str):
        raise InvalidParamError(f"{param} must be a string URL, got {type(url).__name__}", param)
    if is_file_url(url):
        return decode_image_bytes(read_media_file(url, media_dir, param, MAX_IMAGE_BYTES), param)
    if not url.startswith("data:"):
        if ":" not in url[:12]:
            files = (f"; a file inside the {ALLOWED_MEDIA_FLAG} directory as file://{url}" if url.startswith("/")
                     and media_dir is not None else "")
            raise InvalidParamError(f"{param}: kiln takes images as data:image/...;base64 URLs{files}, not as a "
                                    "local path", param)
        raise InvalidParamError(f"{param}: kiln takes images as data:image/...;base64 URLs (or file:// URLs with "
                                f"{ALLOWED_MEDIA_FLAG}), not {url.split(':', 1)[0]!r} URLs (it fetches nothing)",
                                param)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise InvalidParamError(f"{param}: a data URL must be data:image/<type>;base64,<data>, got {header!r}", param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidParamError(f"{param}: the image is larger than {_mib(MAX_IMAGE_BYTES)}", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidParamError(f"{param}: corrupt base64 image data ({exc})", param) from None
    return decode_image_bytes(data, param)


def decode_image_bytes(data: bytes, param: str) -> Image:
    """The decoded image of an image file's bytes (PNG, JPEG, WebP, GIF's first frame, ...)."""
    from PIL import Image as PILImage

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidParamError(f"{param}: the image is larger than {_mib(MAX_IMAGE_BYTES)}", param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            image = PILImage.open(io.BytesIO(data))
            check_image_size(image, param)
            image.load()  # decode now: a truncated or corrupt file fails here, not in the encoder
    except InvalidParamError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise InvalidParamError(f"{param}: the image has more than {MAX_IMAGE_PIXELS} pixels", param) from None
    except (OSError, SyntaxError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise InvalidParamError(f"{param}: not a readable image ({exc})", param) from None
    return image


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def check_image_size(image: Image, param: str) -> None:
    if image.width < 1 or image.height < 1 or image.width * image.height > MAX_IMAGE_PIXELS:
        raise InvalidParamError(f"{param}: the image is {image.width}x{image.height}; kiln takes images of 1 to "
                                f"{MAX_IMAGE_PIXELS} pixels", param)


def check_image_count(count: int, param: str) -> None:
    if count > MAX_IMAGES_PER_REQUEST:
        raise InvalidParamError(f"{param}: {count} images in one request; kiln takes at most "
                                f"{MAX_IMAGES_PER_REQUEST}", param)
