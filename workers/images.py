"""Fetch an image's bytes from S3, check where it comes from and how big it is, and decode it to RGB.

Everything that can be decided from the bytes' header (format, pixel count) is decided before the
full decode, so a decompression bomb never gets its memory.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from shared import names
from shared.errors import (
    ImageDecodeError,
    ImageNotFound,
    ImageSourceForbidden,
    ImageTooLarge,
    UnsupportedImageFormat,
)
from shared.sniff import sniff_format
from shared.store import Store

SUPPORTED_FORMATS = frozenset({"jpg", "png", "webp", "gif", "bmp"})
# PIL's own bomb guard must not fire before ours (ours gives the job's error code); ours is stricter anyway.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, EXIF orientation applied
    width: int
    height: int
    format: str


def fetch(store: Store, uri: str, allowed_buckets: frozenset[str], max_bytes: int) -> bytes:
    """The bytes behind an s3:// URI in an allowed bucket."""
    try:
        bucket, key = names.parse_s3_uri(uri)
    except ValueError:
        raise ImageSourceForbidden("only s3:// URIs are accepted as image sources") from None
    if bucket not in allowed_buckets:
        raise ImageSourceForbidden(f"bucket {bucket!r} is not in the allowed buckets")
    data = store.get_bytes(bucket, key, max_bytes)
    if data is None:
        raise ImageNotFound(f"no object at {uri}")
    return data


def header_size(data: bytes, fmt: str) -> tuple[int, int]:
    """(width, height) from the header alone; PIL's open() parses headers lazily."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(f"{fmt} header unreadable: {exc}") from None
    if width < 1 or height < 1:
        raise ImageDecodeError(f"{fmt} header gives an empty image ({width}x{height})")
    return width, height


def decode(data: bytes, max_pixels: int) -> DecodedImage:
    """Sniff, size-check and decode; raises the MrcError that names what is wrong."""
    if not data:
        raise UnsupportedImageFormat("the image is empty (0 bytes)")
    fmt = sniff_format(data)
    if fmt is None or fmt not in SUPPORTED_FORMATS:
        raise UnsupportedImageFormat(f"not a supported image format ({fmt or 'unknown bytes'})")
    width, height = header_size(data, fmt)
    if width * height > max_pixels:
        raise ImageTooLarge(f"{width}x{height} is {width * height} pixels; the limit is {max_pixels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                img.seek(0)  # animated GIF/WebP: the first frame
                img.load()
                rgb = ImageOps.exif_transpose(img).convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageDecodeError(f"{fmt} data is corrupt or truncated: {exc}") from None
    return DecodedImage(image=rgb, width=rgb.width, height=rgb.height, format=fmt)
