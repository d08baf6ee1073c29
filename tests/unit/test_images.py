from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from shared.errors import (
    ImageDecodeError,
    ImageNotFound,
    ImageSourceForbidden,
    ImageTooLarge,
    UnsupportedImageFormat,
)
from shared.store import MemoryStore
from tests.support import imagegen
from workers import images

LIMIT = 40_000_000


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", UnsupportedImageFormat),
        (b"hello, I am text named .jpg", UnsupportedImageFormat),
        (imagegen.truncated_jpeg(), ImageDecodeError),
        (imagegen.png_header_only(60000, 60000), ImageTooLarge),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, ImageDecodeError),
        (b"II*\x00" + b"\x00" * 20, UnsupportedImageFormat),
    ],
)
def test_bad_bytes_raise_the_error_that_names_them(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        images.load(data, LIMIT)


def test_bomb_is_refused_from_the_header() -> None:
    # 60000 x 60000 x 3 bytes would be 10 GB; the check must happen before any decode.
    with pytest.raises(ImageTooLarge, match="60000x60000"):
        images.load(imagegen.png_header_only(60000, 60000), LIMIT)


@pytest.mark.parametrize(
    "img",
    [
        Image.new("L", (40, 30), 128),
        Image.new("RGBA", (40, 30), (10, 20, 30, 0)),
        Image.new("CMYK", (40, 30), (0, 50, 100, 0)),
        Image.new("I;16", (40, 30), 40000),
        Image.new("P", (40, 30), 3),
    ],
)
def test_modes_become_rgb(img: Image.Image) -> None:
    fmt = "JPEG" if img.mode in ("L", "CMYK") else "PNG"
    decoded = images.load(_encode(img, fmt), LIMIT)
    assert decoded.tensor.dtype == torch.uint8 and decoded.tensor.shape == (3, 30, 40)


def test_exif_orientation_is_applied() -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: a phone photo taken upright
    decoded = images.load(_encode(img, "JPEG", exif=exif.tobytes()), LIMIT)
    assert (decoded.width, decoded.height) == (20, 40)


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    decoded = images.load(out.getvalue(), LIMIT)
    assert decoded.format == "gif" and decoded.tensor[:, 8, 8].tolist()[0] > 200


@pytest.mark.parametrize("size", [(1, 1), (1, 5000), (5000, 1)])
def test_extreme_shapes_decode(size: tuple[int, int]) -> None:
    decoded = images.load(_encode(Image.new("RGB", size), "PNG"), LIMIT)
    assert (decoded.width, decoded.height) == size


def test_fetch_only_from_allowed_buckets() -> None:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/a.jpg", b"data", "image/jpeg")
    sources = {"mrc": ""}
    assert images.fetch(store, "s3://mrc/inputs/a.jpg", sources, 100) == b"data"
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "s3://other/inputs/a.jpg", sources, 100)
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "https://example.com/a.jpg", sources, 100)
    with pytest.raises(ImageNotFound):
        images.fetch(store, "s3://mrc/inputs/missing.jpg", sources, 100)
    with pytest.raises(ImageTooLarge):
        images.fetch(store, "s3://mrc/inputs/a.jpg", sources, 3)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://mrc/../other-bucket/key.jpg",
        "s3://mrc/inputs/../../other/key.jpg",
        "s3://mrc/inputs/./a.jpg",
        "s3://mrc/inputs/..",
        "s3://MRC/inputs/a.jpg",
        "s3://mrc/inputs/a\x00.jpg",
    ],
)
def test_keys_that_could_escape_their_bucket_are_refused(uri: str) -> None:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/a.jpg", b"data", "image/jpeg")
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, uri, {"mrc": ""}, 100)


def test_the_bucket_prefix_bounds_reads_in_our_own_bucket() -> None:
    from shared.settings import Settings

    store = MemoryStore("mrc")
    store.put_bytes("tenant-a/inputs/a.jpg", b"data", "image/jpeg")
    store.put_bytes("tenant-b/inputs/b.jpg", b"data", "image/jpeg")
    sources = Settings(s3_prefix="tenant-a", allowed_buckets=["photos"]).image_sources
    assert sources == {"mrc": "tenant-a/", "photos": ""}
    assert images.fetch(store, "s3://mrc/tenant-a/inputs/a.jpg", sources, 100) == b"data"
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "s3://mrc/tenant-b/inputs/b.jpg", sources, 100)
