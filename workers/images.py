"""Fetch an image's bytes from S3, check where they come from and how big the image is, and decode it.

Everything that can be decided from the bytes (format, pixel count) is decided before the full
decode, so a decompression bomb never gets its memory: that includes the frame count of animated
images, since a decoder may draw every frame. JPEG on the CPU goes through TurboJPEG, which names
corrupt data where other libjpeg decoders fill it grey (workers/jpeg_decode.py); torchvision.io decodes
WebP, still GIF and JPEG on the GPU (nvjpeg, when the device is CUDA). Each gives a uint8 RGB CHW
tensor whose bytes lie pixel by pixel (channels last, as decoders write them: `channels_last`); the
EXIF orientation read from the header is applied afterwards, the same way on every device. PIL decodes
what torchvision cannot or should not (PNG, BMP, animated images: first frame only), and reads headers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import struct
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from shared import frames, names, sniff
from shared.errors import (
    ImageDecodeError,
    ImageNotFound,
    ImageSourceForbidden,
    ImageTooLarge,
    MrcError,
    UnsupportedImageFormat,
)
from shared.sniff import sniff_format
from shared.stores import ImageSource
from workers import jpeg_decode, jpeg_scans, png_data

if TYPE_CHECKING:
    import torch

# torch and torchvision are imported by the functions that decode, not with this module: fetching and
# header checks need neither, and a worker whose model reads no pixels (echo) never loads torch.

SUPPORTED_FORMATS = sniff.SUPPORTED_FORMATS
# Not PNG: torchvision's libpng path segfaults on some corrupt PNGs (found by fuzzing: one mangled
# IDAT chunk kills the process, and with acks_late every worker that takes the job after it).
# WebP and GIF survived 1,200 random mutations each (tests/unit/test_decode_fuzz.py), as did JPEG,
# which goes to nvjpeg on a GPU and to TurboJPEG on the CPU (`_decode_jpeg`).
# GIF only when it is a still: torchvision's decode_gif draws every frame onto the full canvas.
_TORCHVISION_FORMATS = frozenset({"webp", "gif"})
_ORIENTATION_TAG = 0x0112
_SWAPS_SIDES = frozenset({5, 6, 7, 8})
# PIL's own bomb guard must not fire before ours (ours gives the job its error code and is stricter).
Image.MAX_IMAGE_PIXELS = None
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")
_DECODE_ERRORS = (RuntimeError, ValueError, OSError, SyntaxError, EOFError, UnidentifiedImageError)


@dataclass(frozen=True)
class EncodedImage:
    """Bytes that passed the checks that need no decode."""

    data: bytes
    format: str
    width: int  # as displayed: sides swapped for an EXIF orientation that rotates by 90 degrees
    height: int
    orientation: int = 1  # EXIF orientation (1-8), applied after decoding, on whatever device
    frames: int = 1
    sha256: str = ""  # of the bytes themselves: what the result reports and the cache keys on

    def without_bytes(self) -> EncodedImage:
        """What a job keeps once its bytes are decoded (or answered from the cache): the header's facts
        and the hash, for its result; not up to MRC_MAX_IMAGE_BYTES until its delivery ends."""
        return dataclasses.replace(self, data=b"")


@dataclass(frozen=True)
class ImageSize:
    """What the result needs of a decoded image: its size as decoded (oriented)."""

    width: int
    height: int


@dataclass(frozen=True)
class DecodedImage:
    tensor: Any  # uint8 torch tensor, [3, H, W], RGB, EXIF orientation applied; maybe already shrunk
    format: str
    height: int  # of the image as decoded (oriented), whatever the tensor was shrunk to since
    width: int
    pixels: Any = None  # the model's input made from it already (ModelBackend.image_pixels), or None

    @property
    def size(self) -> ImageSize:
        return ImageSize(self.width, self.height)


def fetch(source: ImageSource, uri: str, sources: Mapping[str, str], max_bytes: int) -> bytes:
    """The bytes behind an s3:// URI in an allowed bucket (`sources`: bucket -> the key prefix required);
    nothing else is ever fetched."""
    try:
        bucket, key = names.parse_s3_uri(uri)
    except ValueError as exc:
        raise ImageSourceForbidden(f"only plain s3://bucket/key URIs are accepted: {exc}") from None
    if bucket not in sources:
        raise ImageSourceForbidden(f"bucket {bucket!r} is not in the allowed buckets")
    if not names.key_allowed(key, sources[bucket]):
        raise ImageSourceForbidden(f"key {key[:80]!r} is outside the prefix {sources[bucket]!r}")
    data = source.get_bytes(bucket, key, max_bytes)
    if data is None:
        raise ImageNotFound(f"no object at {uri}")
    return data


def inspect(data: bytes, max_pixels: int) -> EncodedImage:
    """Sniff the real format, read size, orientation and frame count from the header; refuse what
    must not be decoded. Frames count against the pixel limit: a decoder may draw each one."""
    if not data:
        raise UnsupportedImageFormat("the image is empty (0 bytes)")
    fmt = sniff_format(data)
    if fmt is None or fmt not in SUPPORTED_FORMATS:
        raise UnsupportedImageFormat(f"not a supported image format ({fmt or 'unknown bytes'})")
    try:
        with Image.open(io.BytesIO(data)) as img:  # parses the header only
            width, height = img.size
            orientation = _orientation(img)
            framed = png_data.frame_problem(img.size, img.tile) if fmt == "png" else None
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(f"{fmt} header unreadable: {_said(exc)}") from None
    if width < 1 or height < 1:
        raise ImageDecodeError(f"{fmt} header gives an empty image ({width}x{height})")
    shown = (height, width) if orientation in _SWAPS_SIDES else (width, height)
    count = frames.frame_count(data, fmt) if width * height <= max_pixels else 1
    refused: MrcError | None = None
    if width * height > max_pixels:
        refused = ImageTooLarge(f"{width}x{height} is {width * height} pixels; the limit is {max_pixels}")
    elif width * height * count > max_pixels:
        total = width * height * count
        refused = ImageTooLarge(f"{count} frames of {width}x{height}: {total} pixels; limit {max_pixels}")
    elif framed is not None:  # before any decode: PIL would draw that frame alone, the rest black
        refused = ImageDecodeError(f"png data is not a whole image: {framed}")
    if refused is not None:
        refused.image_size = shown
        raise refused
    width, height = shown
    return EncodedImage(data, fmt, width, height, orientation, count, hashlib.sha256(data).hexdigest())


def _said(exc: BaseException) -> str:
    """A decoder's words without the objects it names: PIL's "cannot identify image file
    <_io.BytesIO object at 0x7f...>" gave clients an address in the worker's memory (review, helper-73)."""
    return _OBJECT_REPR.sub("", str(exc)).strip() or type(exc).__name__


_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


def _orientation(img: Image.Image) -> int:
    """The orientation the header carries (1 when none), read where PIL's `exif_transpose` reads it:
    EXIF (a JPEG's APP1, a PNG's eXIf chunk or ImageMagick's "Raw profile type exif" text, WebP's
    EXIF chunk), else XMP's `tiff:Orientation` (before, a photo oriented in XMP alone was shown as
    stored where PIL would turn it). Only what is read with the header counts: a PNG whose eXIf chunk
    follows the pixel data is taken as it is stored (PIL's `getexif` would decode the whole image to
    find it)."""
    exif = Image.Exif()
    try:
        raw = img.info.get("exif")
        if raw is None and isinstance(profile := img.info.get("Raw profile type exif"), str):
            raw = bytes.fromhex("".join(profile.split("\n")[3:]))
        if raw:
            exif.load(raw)
        value = exif.get(_ORIENTATION_TAG)
    except (*_DECODE_ERRORS, TypeError, struct.error):
        return 1
    if value is None:
        value = _xmp_orientation(img.info.get("XML:com.adobe.xmp") or img.info.get("xmp"))
    try:
        turned = int(value) if value is not None else 1
    except (TypeError, ValueError):
        return 1
    return turned if 1 <= turned <= 8 else 1


# PIL's pattern (Image.getexif): the attribute form and the element form, one digit.
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def _xmp_orientation(packet: object) -> int | None:
    """XMP's `tiff:Orientation`: a PNG's iTXt packet (text) or a JPEG's, WebP's or GIF's (bytes)."""
    if isinstance(packet, str):
        packet = packet.encode("utf-8", "surrogatepass")
    if not isinstance(packet, bytes | bytearray):
        return None
    found = _XMP_ORIENTATION.search(packet)
    return int(found[2]) if found else None


def decode(image: EncodedImage, device: str = "cpu") -> DecodedImage:
    """Decode checked bytes to a uint8 RGB CHW tensor (on `device` for JPEG when it is CUDA), first
    frame only, then orient it. Orientation is applied here and never by a decoder, so every decoder
    and every device gives the same picture (nvjpeg ignores EXIF orientation)."""
    tensor: Any = None
    if image.format == "jpg":
        tensor = _decode_jpeg(image, device)
        if (gap := jpeg_scans.progression_gap(image.data)) is not None:
            said = "jpg data is corrupt or truncated" if gap.startswith("its scans") else "jpg refused"
            raise ImageDecodeError(f"{said}: {gap}")
    elif image.format in _TORCHVISION_FORMATS and image.frames == 1:
        try:
            tensor = _decode_torchvision(image, device)
        except _DECODE_ERRORS:
            tensor = None  # PIL below names the fault, or decodes what torchvision would not
    if tensor is None:
        tensor = _decode_pil(image)
    tensor = orient(tensor, image.orientation)
    if tuple(tensor.shape[-2:]) != (image.height, image.width):
        raise ImageDecodeError(f"decoded size {tuple(tensor.shape[-2:])} disagrees with the header")
    return DecodedImage(tensor, image.format, int(tensor.shape[1]), int(tensor.shape[2]))


def orient(tensor: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation to a CHW tensor: PIL's ImageOps.exif_transpose, as tensor views."""
    import torch

    hw = (-2, -1)
    oriented = {
        2: lambda t: t.flip(-1),
        3: lambda t: t.flip(hw),
        4: lambda t: t.flip(-2),
        5: lambda t: t.transpose(*hw),
        6: lambda t: torch.rot90(t, -1, hw),
        7: lambda t: t.transpose(*hw).flip(hw),
        8: lambda t: torch.rot90(t, 1, hw),
    }.get(orientation)
    return tensor if oriented is None else channels_last(oriented(tensor))


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """A CHW tensor whose bytes lie pixel by pixel (HWC in memory), copied only when they do not.

    Decoders write pixels that way; making them plane by plane (CHW-contiguous) cost a full copy of
    every photo (a 12 MP photo: 39 ms on one core), and every step after it wants pixels: the
    antialiased uint8 resize runs 2-5x faster on them and the patch reorder moves whole 30-pixel runs
    (docs/benchmarks.md, "Preprocessing"). The values are the same either way. A tensor on a GPU
    (nvjpeg's) is left as the decoder made it, until a GPU measures the layouts; what a GPU worker
    decodes on its CPU (PNG, WebP, GIF, BMP) goes to the device pixel by pixel (`.to` keeps strides),
    where the resize and the patch reorder read any strides (tests/gpu checks the values)."""
    if tensor.device.type != "cpu" or tensor.permute(1, 2, 0).is_contiguous():
        return tensor
    return tensor.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def _decode_jpeg(image: EncodedImage, device: str) -> torch.Tensor | None:
    """nvjpeg on a CUDA device, else (or where nvjpeg refuses it) TurboJPEG on the CPU, which refuses a
    JPEG whose pixels libjpeg says are missing or wrong (torchvision's and PIL's libjpeg decode those
    grey or garbled and say nothing). None where neither can decode it: PIL then tries, or names why."""
    import torch

    if device.startswith("cuda"):
        try:
            return _decode_torchvision(image, device)
        except _DECODE_ERRORS:
            pass  # TurboJPEG names the fault, or decodes what nvjpeg would not
    pixels = jpeg_decode.decode(image.data)
    return None if pixels is None else torch.from_numpy(pixels).permute(2, 0, 1)  # HWC bytes


def _decode_torchvision(image: EncodedImage, device: str) -> torch.Tensor:
    import torch
    import torchvision.transforms.v2.functional as tvF
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    raw = torch.frombuffer(bytearray(image.data), dtype=torch.uint8)
    if image.format == "jpg":
        tensor = decode_jpeg(raw, mode=ImageReadMode.RGB, apply_exif_orientation=False, device=device)
    else:
        tensor = decode_image(raw, mode=ImageReadMode.RGB, apply_exif_orientation=False)
    if tensor.ndim == 4:  # several frames after all: Fuyu takes one image
        tensor = tensor[0]
    if tensor.dtype != torch.uint8:  # 16-bit PNG: scale to 8 bits (PIL would clip instead)
        tensor = tvF.to_dtype(tensor, torch.uint8, scale=True)
    if tensor.shape[0] == 1:
        tensor = tensor.expand(3, -1, -1)
    return channels_last(tensor)


def _decode_pil(image: EncodedImage) -> torch.Tensor:
    """The first frame only: PIL decodes a GIF, APNG or WebP frame by frame, on demand."""
    import numpy as np
    import torch

    try:
        with Image.open(io.BytesIO(image.data)) as img:
            img.seek(0)
            tile = list(img.tile)  # what PIL decodes: gone once it has
            img.load()
            _check_rows_written(image, img, tile)
            rgb = _to_rgb(img)
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(f"{image.format} data is corrupt or truncated: {_said(exc)}") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)  # HWC bytes: `channels_last`


def _check_rows_written(image: EncodedImage, img: Image.Image, tile: list[Any]) -> None:
    """Refuse a PNG whose pixel stream ended early: PIL leaves the unwritten rows black and says
    nothing. Counting the stream costs another inflate (0.15-0.2 s for 12 MP), so it runs only when the
    decode could have stopped short: an interlaced image (its passes spread the gap), or a last row
    still all zero bytes, as PIL's fresh image memory is."""
    if image.format != "png":
        return
    width, height = img.size
    if not img.info.get("interlace") and img.crop((0, height - 1, width, height)).tobytes().strip(b"\0"):
        return
    missing = png_data.shortfall(image.data, img.size, tile, bool(img.info.get("interlace")))
    if missing is not None:
        raise ImageDecodeError(f"png data is truncated: {missing}; the rest would decode blank")


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, scaling 16-bit grey to 8 bits (PIL's own conversion clips it, turning the image white)."""
    import numpy as np

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
    thread keeps the model's team intact; the decodes still run in parallel across threads. A worker
    that has not loaded torch (its model reads no pixels) has no team to keep."""
    if sys.modules.get("torch") is not None:  # (None: an import blocked on purpose)
        # imported again, not taken from sys.modules: another thread may be importing it this moment,
        # and the import waits for that one to finish (the half-made module has no set_num_threads)
        import torch

        torch.set_num_threads(1)


@dataclass(frozen=True)
class Shape:
    """Stands for a decoded image's tensor where a model reads only its size (the echo backend): the
    header's width and height, oriented, as `tensor.shape` would give them."""

    shape: tuple[int, int, int]


def sized(image: EncodedImage) -> DecodedImage:
    """The image as a model that reads no pixels sees it: its oriented size, from the header (checked
    already), without decoding (so without torch)."""
    return DecodedImage(Shape((3, image.height, image.width)), image.format, image.height, image.width)


def load(data: bytes, max_pixels: int, device: str = "cpu") -> DecodedImage:
    """inspect + decode, for callers that hold the bytes already."""
    return decode(inspect(data, max_pixels), device)
