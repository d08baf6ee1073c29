"""The decoder-free header reader agrees with PIL on every format the worker accepts."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shared.dimensions import image_size
from shared.sniff import sniff_format
from tests.support import imagegen


def _encode(width: int, height: int, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, format=fmt, **options)
    return out.getvalue()


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 3000),
    height=st.integers(1, 3000),
    fmt=st.sampled_from(["JPEG", "PNG", "GIF", "BMP", "WEBP"]),
    lossless=st.booleans(),
    progressive=st.booleans(),
)
def test_the_header_size_matches_pil(
    width: int, height: int, fmt: str, lossless: bool, progressive: bool
) -> None:
    options: dict[str, object] = {}
    if fmt == "WEBP":
        options["lossless"] = lossless
    if fmt == "JPEG":
        options["progressive"] = progressive
    data = _encode(width, height, fmt, **options)
    assert image_size(data, sniff_format(data) or "") == (width, height)


def test_exif_jpeg_animated_gif_and_header_only_bombs() -> None:
    photo = imagegen.camera_photo(640, 480, seed=1)
    assert image_size(photo, "jpg") == (640, 480)
    assert image_size(imagegen.png_header_only(60000, 60000), "png") == (60000, 60000)
    bomb = imagegen.gif_bomb(2000, 2000, 50)
    assert image_size(bomb, "gif") == (2000, 2000)


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBPVP8Z"]
)
def test_truncated_or_odd_headers_give_none_not_an_error(data: bytes) -> None:
    fmt = sniff_format(data) or "jpg"
    assert image_size(data, fmt) is None or isinstance(image_size(data, fmt), tuple)
    assert image_size(data, "tiff") is None


def _os2_bmp(width: int, height: int) -> bytes:
    row = (width * 3 + 3) // 4 * 4
    core = struct.pack("<IHHHH", 12, width, height, 1, 24)  # BITMAPCOREHEADER: 16-bit sizes
    return b"BM" + struct.pack("<IHHI", 26 + row * height, 0, 0, 26) + core + b"\0" * row * height


def test_a_gif_frame_past_its_screen_and_an_os2_bmp_are_read_as_pil_reads_them() -> None:
    """Review: a 1x1 GIF screen around a 3000x2000 frame read as 1x1, and a BMP with the old 12-byte
    header as garbage: both passed mrc-api's pixel limit, to be refused by the worker after upload."""
    frame = (
        b"\x2c" + struct.pack("<HHHHB", 5, 7, 3000, 2000, 0x80) + b"\0\0\0\xff\xff\xff\x02\x02\x4c\x01\x00"
    )
    gif = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0, 0, 0) + frame + b"\x3b"
    for data, fmt in ((gif, "gif"), (_os2_bmp(300, 200), "bmp")):
        assert image_size(data, fmt) == Image.open(io.BytesIO(data)).size, fmt
