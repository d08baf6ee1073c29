"""Images made on the fly for tests and the demo: good ones and deliberately broken ones."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image, ImageDraw

from scripts.samples import photo

__all__ = [
    "apng_default_frame",
    "camera_photo",
    "gif_bomb",
    "jpeg_sampled",
    "photo",
    "png_file",
    "png_header_only",
    "png_rows",
    "screenshot",
    "truncated_jpeg",
]


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


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def _png(width: int, height: int, pixel_data: bytes, interlace: int = 0, before_pixels: bytes = b"") -> bytes:
    """An 8-bit RGB PNG around filtered pixel data, well formed chunk by chunk (CRCs and all);
    `before_pixels`: chunks to put between the header and the pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + before_pixels
        + _chunk(b"IDAT", zlib.compress(pixel_data))
        + _chunk(b"IEND", b"")
    )


def png_file(*chunks: tuple[bytes, bytes]) -> bytes:
    """A PNG of these (type, body) chunks in this order, each with its length and CRC: for files
    whose structure a test lays out itself."""
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(kind, body) for kind, body in chunks)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims a huge size, with one tiny IDAT: a decompression bomb's header."""
    return _png(width, height, b"\x00" * 16)


def png_rows(
    rgb: bytes,
    width: int,
    height: int,
    interlaced: bool = False,
    rows_kept: int | None = None,
    interlace_byte: int = 1,
) -> bytes:
    """An RGB PNG of these pixels (row by row, 3 bytes each), Adam7-interlaced if asked, whose
    compressed stream ends cleanly after its first `rows_kept` filtered rows (of all passes, in
    order) when that is given: a file every chunk of which is valid, and whose pixels run out early.
    PIL refuses a stream cut inside a row; at a row's end it said nothing. `interlace_byte`: the
    header's interlace method when interlaced (PIL reads any byte but 0 as Adam7)."""
    passes = [
        (0, 0, 8, 8),
        (4, 0, 8, 8),
        (0, 4, 4, 8),
        (2, 0, 4, 4),
        (0, 2, 2, 4),
        (1, 0, 2, 2),
        (0, 1, 1, 2),
    ]
    rows = []
    for x0, y0, dx, dy in passes if interlaced else [(0, 0, 1, 1)]:
        if x0 >= width:
            continue  # a pass with no columns has no rows either, not empty ones
        for y in range(y0, height, dy):
            line = rgb[y * width * 3 : (y + 1) * width * 3]
            rows.append(b"\x00" + b"".join(line[x * 3 : x * 3 + 3] for x in range(x0, width, dx)))
    return _png(width, height, b"".join(rows[:rows_kept]), interlace_byte if interlaced else 0)


def apng_default_frame(rgb: bytes, width: int, height: int, frame: tuple[int, int, int, int]) -> bytes:
    """A one-frame animated PNG whose pixel data is the whole image and whose default image's frame
    (the fcTL before IDAT: width, height, x, y) is `frame`; the APNG spec says it must be the whole
    image."""
    actl = _chunk(b"acTL", struct.pack(">II", 1, 0))
    fctl = _chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, *frame, 1, 10, 0, 0))
    rows = b"".join(b"\x00" + rgb[y * width * 3 : (y + 1) * width * 3] for y in range(height))
    return _png(width, height, rows, before_pixels=actl + fctl)


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


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def _grey_jpeg_parts(plane: object) -> tuple[bytes, list[bytes], bytes]:
    """A grey JPEG of `plane`, split: its quantisation table, its Huffman tables, its scan's data."""
    out = io.BytesIO()
    Image.fromarray(plane, "L").save(out, format="JPEG", quality=85)  # type: ignore[call-overload]
    data, at, tables, huffman = out.getvalue(), 2, b"", []
    while True:
        marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4], "big")
        payload = data[at + 4 : at + 2 + length]
        at += 2 + length
        if marker == 0xDB:
            tables = payload
        elif marker == 0xC4:
            huffman.append(payload)
        elif marker == 0xDA:
            return tables, huffman, data[at:-2]


def jpeg_sampled(width: int, height: int, sampling: list[tuple[int, int]]) -> bytes:
    """A valid baseline YCbCr JPEG with the sampling factors given (horizontal, vertical per component),
    one component per scan: layouts PIL's encoder does not write (luma 1x3, chroma larger than luma,
    Y 1x4 with chroma 1x1), which some cameras and tools do (review, helper-95)."""
    import numpy as np

    picture = Image.open(io.BytesIO(photo(width, height, seed=3, fmt="PNG"))).convert("YCbCr")
    widest, tallest = max(h for h, _ in sampling), max(v for _, v in sampling)
    tables, components, scans = b"", b"", b""
    for index, ((h, v), plane) in enumerate(zip(sampling, picture.split(), strict=True)):
        size = (-(-width * h // widest), -(-height * v // tallest))
        quant, huffman, scan = _grey_jpeg_parts(np.asarray(plane.resize(size)))
        tables += bytes([quant[0] & 0xF0 | index]) + quant[1:]
        components += bytes([index + 1, (h << 4) | v, index])
        scans += b"".join(_segment(0xC4, table) for table in huffman)
        scans += _segment(0xDA, bytes([1, index + 1, 0x00, 0, 63, 0])) + scan
    frame = bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes([3]) + components
    jfif = _segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    return b"\xff\xd8" + jfif + _segment(0xDB, tables) + _segment(0xC0, frame) + scans + b"\xff\xd9"
