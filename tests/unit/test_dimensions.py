"""The decoder-free header reader agrees with PIL on every format the worker accepts."""

from __future__ import annotations

import io

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
