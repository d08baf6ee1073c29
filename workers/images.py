"""Fetch an image's bytes from S3, check where they come from and how big the image is, and decode it.

Everything that can be decided from the bytes (format, pixel count) is decided before the full
decode, so a decompression bomb never gets its memory. Decoding uses torchvision.io (libjpeg-turbo,
libpng, libwebp; JPEG on the GPU with nvjpeg when the device is CUDA) and gives a uint8 RGB CHW
tensor with EXIF orientation applied. PIL decodes only what torchvision cannot (BMP, animated WebP),
and reads headers.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.v2.functional as tvF
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

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
# Not PNG: torchvision's libpng path segfaults on some corrupt PNGs (found by fuzzing: one mangled
# IDAT chunk kills the process, and with acks_late every worker that takes the job after it).
# JPEG, WebP and GIF survived 1,200 random mutations each (tests/unit/test_decode_fuzz.py).
_TORCHVISION_FORMATS = frozenset({"jpg", "webp", "gif"})
# PIL's own bomb guard must not fire before ours (ours gives the job its error code and is stricter).
Image.MAX_IMAGE_PIXELS = None
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")
_DECODE_ERRORS = (RuntimeError, ValueError, OSError, SyntaxError, EOFError, UnidentifiedImageError)


@dataclass(frozen=True)
class EncodedImage:
    """Bytes that passed the checks that need no decode."""

    data: bytes
    format: str
    width: int
    height: int


@dataclass(frozen=True)
class DecodedImage:
    tensor: torch.Tensor  # uint8, [3, H, W], RGB, EXIF orientation applied; maybe already shrunk
    format: str
    height: int  # of the image as decoded (oriented), whatever the tensor was shrunk to since
    width: int


def fetch(store: Store, uri: str, sources: Mapping[str, str], max_bytes: int) -> bytes:
    """The bytes behind an s3:// URI in an allowed bucket (`sources`: bucket -> required key prefix);
    nothing else is ever fetched."""
    try:
        bucket, key = names.parse_s3_uri(uri)
    except ValueError as exc:
        raise ImageSourceForbidden(f"only plain s3://bucket/key URIs are accepted: {exc}") from None
    if bucket not in sources:
        raise ImageSourceForbidden(f"bucket {bucket!r} is not in the allowed buckets")
    if not names.key_allowed(key, sources[bucket]):
        raise ImageSourceForbidden(f"key {key[:80]!r} is outside the prefix {sources[bucket]!r}")
    data = store.get_bytes(bucket, key, max_bytes)
    if data is None:
        raise ImageNotFound(f"no object at {uri}")
    return data


def inspect(data: bytes, max_pixels: int) -> EncodedImage:
    """Sniff the real format and read the size from the header; refuse what must not be decoded."""
    if not data:
        raise UnsupportedImageFormat("the image is empty (0 bytes)")
    fmt = sniff_format(data)
    if fmt is None or fmt not in SUPPORTED_FORMATS:
        raise UnsupportedImageFormat(f"not a supported image format ({fmt or 'unknown bytes'})")
    try:
        with Image.open(io.BytesIO(data)) as img:  # parses the header only
            width, height = img.size
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(f"{fmt} header unreadable: {exc}") from None
    if width < 1 or height < 1:
        raise ImageDecodeError(f"{fmt} header gives an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageTooLarge(f"{width}x{height} is {width * height} pixels; the limit is {max_pixels}")
    return EncodedImage(data, fmt, width, height)


def decode(image: EncodedImage, device: str = "cpu") -> DecodedImage:
    """Decode checked bytes to a uint8 RGB CHW tensor, on `device` for JPEG when it is CUDA."""
    tensor: torch.Tensor | None = None
    if image.format in _TORCHVISION_FORMATS:
        try:
            tensor = _decode_torchvision(image, device)
        except _DECODE_ERRORS:
            tensor = None  # e.g. animated WebP: PIL below reads its first frame, or names the fault
    if tensor is None:
        tensor = _decode_pil(image)
    if tuple(tensor.shape[-2:]) not in ((image.height, image.width), (image.width, image.height)):
        raise ImageDecodeError(f"decoded size {tuple(tensor.shape[-2:])} disagrees with the header")
    return DecodedImage(tensor, image.format, int(tensor.shape[1]), int(tensor.shape[2]))


def _decode_torchvision(image: EncodedImage, device: str) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(image.data), dtype=torch.uint8)
    if image.format == "jpg":
        tensor = decode_jpeg(raw, mode=ImageReadMode.RGB, apply_exif_orientation=True, device=device)
    else:
        tensor = decode_image(raw, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    if tensor.ndim == 4:  # animated GIF: all frames come back; Fuyu takes one image
        tensor = tensor[0]
    if tensor.dtype != torch.uint8:  # 16-bit PNG: scale to 8 bits (PIL would clip instead)
        tensor = tvF.to_dtype(tensor, torch.uint8, scale=True)
    if tensor.shape[0] == 1:
        tensor = tensor.expand(3, -1, -1)
    rgb: torch.Tensor = tensor.contiguous()
    return rgb


def _decode_pil(image: EncodedImage) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(image.data)) as img:
            img.seek(0)  # animated: the first frame
            img.load()
            rgb = _to_rgb(ImageOps.exif_transpose(img))
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(f"{image.format} data is corrupt or truncated: {exc}") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, scaling 16-bit grey to 8 bits (PIL's own conversion clips it, turning the image white)."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        wide = np.asarray(img, dtype=np.uint32)
        grey = (
            (wide >> 8).astype(np.uint8)
            if wide.max(initial=0) > 255 or img.mode != "I"
            else wide.astype(np.uint8)
        )
        return Image.fromarray(grey, mode="L").convert("RGB")
    return img.convert("RGB")


def init_decode_thread() -> None:
    """Thread-pool initializer. A thread that runs ATen ops gets an OpenMP team of its own, sized to
    the cores; with several decode threads that oversubscribes the cores the model's team runs on
    (measured: generate 1.7x slower for the rest of the process). One OpenMP thread per decode
    thread keeps the model's team intact; the decodes still run in parallel across threads."""
    torch.set_num_threads(1)


def load(data: bytes, max_pixels: int, device: str = "cpu") -> DecodedImage:
    """inspect + decode, for callers that hold the bytes already."""
    return decode(inspect(data, max_pixels), device)
