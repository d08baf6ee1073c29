"""Images made on the fly for tests and the demo: good ones and deliberately broken ones."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image, ImageDraw

from scripts.samples import photo

__all__ = ["camera_photo", "gif_bomb", "photo", "png_header_only", "screenshot", "truncated_jpeg"]


def camera_photo(width: int, height: int, seed: int = 0) -> bytes:
    """A phone-camera-like JPEG: the synthetic scene plus sensor noise, so it has a photo's entropy
    (and decode cost) rather than the few KB a flat synthetic image compresses to."""
    import numpy as np

    base = Image.open(io.BytesIO(photo(width, height, seed=seed, fmt="PNG"))).convert("RGB")
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 12, size=(height, width, 3))
    pixels = np.clip(np.asarray(base, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def screenshot(width: int, height: int, seed: int = 0) -> bytes:
    """A UI-like PNG: flat panels and text, as screenshots are."""
    img = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    for row in range(0, height, 40):
        draw.rectangle([20, row + 5, width - 20, row + 30], fill=(230 - (row + seed) % 50, 235, 250))
        draw.text(
            (30, row + 10), f"Order #{seed}-{row} delivered damaged, refund requested", fill=(20, 20, 20)
        )
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def truncated_jpeg() -> bytes:
    data = photo(320, 240, seed=7)
    return data[: len(data) // 2]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims a huge size, with one tiny IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def gif_bomb(width: int, height: int, frames: int) -> bytes:
    """A GIF of `frames` 1x1 frames on a width x height canvas: a few bytes per frame, but a decoder
    that draws every frame spends the whole canvas on each one."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00")
    out += b"\x00\x00\x00\xff\xff\xff"  # global colour table: black, white
    for i in range(frames):
        out += b"\x21\xf9\x04\x00\x00\x00\x00\x00"  # graphic control: no disposal, no delay
        out += b"\x2c" + struct.pack("<HHHH", i % width, (i // width) % height, 1, 1) + b"\x00"
        out += b"\x02\x02\x4c\x01\x00"  # LZW (min code 2): clear, white, end
    return bytes(out + b";")
