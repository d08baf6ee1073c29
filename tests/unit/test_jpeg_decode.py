"""JPEG on the CPU: the same pixels as PIL (the processor's decoder) and torchvision, and a refusal
where libjpeg says pixels are missing or wrong, which both of those decode grey or garbled."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shared.errors import ImageDecodeError
from tests.support import imagegen
from workers import images, jpeg_decode

LIMIT = 40_000_000


def _jpeg(img: Image.Image, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", **kw)
    return out.getvalue()


def _noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode)
    pixels = rng.integers(0, 256, (height, width, bands), np.uint8)
    return Image.frombytes(mode, (width, height), pixels.tobytes())


def _pil_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _scan_bounds(data: bytes) -> tuple[int, int]:
    """Where the first scan's entropy-coded data starts and where the end marker is."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big"), len(data) - 2


def _without_adobe_marker(data: bytes) -> bytes:
    at = data.index(b"\xff\xee")
    return data[:at] + data[at + 2 + int.from_bytes(data[at + 2 : at + 4], "big") :]


CMYK = _jpeg(_noise(64, 48, "CMYK", seed=3), quality=100)
CLEAN = {
    "4:2:0": _jpeg(_noise(161, 99), quality=90),
    "4:2:2": _jpeg(_noise(161, 99), quality=75, subsampling=1),
    "4:4:4": _jpeg(_noise(33, 17), quality=95, subsampling=0),
    "progressive": _jpeg(_noise(120, 81), quality=50, progressive=True),
    "optimised": _jpeg(_noise(64, 64), optimize=True),
    "restart markers": _jpeg(_noise(200, 100), restart_marker_blocks=1),
    "grey": _jpeg(_noise(70, 50, "L")),
    "1x1": _jpeg(_noise(1, 1)),
    "cmyk (Adobe)": CMYK,
    "cmyk (no Adobe marker)": _without_adobe_marker(CMYK),
    "camera photo": imagegen.camera_photo(320, 240),
}


@pytest.mark.parametrize("kind", list(CLEAN))
def test_a_whole_jpeg_decodes_to_the_processors_pixels(kind: str) -> None:
    data = CLEAN[kind]
    decoded = images.load(data, LIMIT).tensor
    assert decoded.dtype == torch.uint8
    assert decoded.shape[0] == 3
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(data))


def test_the_pixels_lie_pixel_by_pixel_as_the_preprocessing_wants() -> None:
    assert images.load(CLEAN["4:2:0"], LIMIT).tensor.permute(1, 2, 0).is_contiguous()


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_a_jpeg_cut_short_is_refused_with_or_without_an_end_marker(
    fraction: float, progressive: bool
) -> None:
    """Before: a cut JPEG given an end marker decoded, its missing rows grey (128, 128, 128), and the
    model answered about that picture. libjpeg only warned, to stderr."""
    data = _jpeg(_noise(160, 120), quality=90, progressive=progressive)
    cut = data[: int(len(data) * fraction)]
    ended = (cut + b"\xff\xd9", "premature end of data segment")
    for damaged, said in (ended, (cut, "Premature end of JPEG file")):
        with pytest.raises(ImageDecodeError, match="jpg data is corrupt or truncated") as refused:
            images.load(damaged, LIMIT)
        assert said in str(refused.value)


def test_a_marker_inside_the_scan_and_a_bad_huffman_code_are_refused() -> None:
    data = CLEAN["camera photo"]
    start, end = _scan_bounds(data)
    middle = (start + end) // 2
    marker, bad_code = (b"\xff\xd3", "premature end of data segment"), (b"\xff\x00" * 40, "bad Huffman code")
    for inserted, said in (marker, bad_code):
        with pytest.raises(ImageDecodeError, match=said):
            images.load(data[:middle] + inserted + data[middle:], LIMIT)


def test_a_cmyk_jpeg_cut_short_is_refused_too() -> None:
    with pytest.raises(ImageDecodeError, match="premature end of data segment"):
        images.load(CMYK[: len(CMYK) // 2] + b"\xff\xd9", LIMIT)


def test_extraneous_bytes_before_the_end_marker_leave_the_photo_whole() -> None:
    """Some cameras pad before the end marker and libjpeg warns of it; the pixels are all there, so the
    photo is decoded, not refused."""
    data = CLEAN["camera photo"]
    padded = data[:-2] + b"\x00\x00\x00" + data[-2:]
    decoded = images.load(padded, LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(data))


def test_what_turbojpeg_cannot_read_is_left_for_the_other_decoders_to_name() -> None:
    assert jpeg_decode.decode(b"\xff\xd8\xff\xe0 not a jpeg after all") is None
    with pytest.raises(ImageDecodeError):
        images.load(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 40, LIMIT)


def test_cmyk_to_rgb_is_pils_rounding_for_every_pair_of_values() -> None:
    values = np.arange(256, dtype=np.uint8)
    c, k = np.meshgrid(values, values, indexing="ij")
    cmyk = np.stack([c, c, c, k], axis=-1)
    expected = (c.astype(np.uint32) * k + 127) // 255  # C·K/255 rounded to nearest
    assert np.array_equal(jpeg_decode._cmyk_to_rgb(cmyk)[..., 0], expected.astype(np.uint8))
