"""An image's width and height from its header bytes, without a decoder (the producer side has neither
PIL nor torch): what lets mrc-api refuse a decompression bomb before it is uploaded. The worker checks
again with its own decoder (workers/images.py), so a header this reader cannot parse is left to it.
"""

from __future__ import annotations

import struct

from shared import frames

# JPEG start-of-frame markers (baseline, extended, progressive, lossless, arithmetic); not DHT/JPG/DAC.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) from the header of `data` in format `fmt` ("jpg", "png", ...), or None."""
    try:
        reader = _READERS.get(fmt)
        return reader(data) if reader is not None else None
    except (struct.error, IndexError, ValueError):
        return None


def _png(data: bytes) -> tuple[int, int] | None:
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _gif(data: bytes) -> tuple[int, int]:
    """The logical screen, grown to hold every frame: a decoder draws a frame past the screen on a
    canvas that large (review: a 1x1 screen around one 20000x20000 frame passed as 1 pixel)."""
    width, height = (int(n) for n in struct.unpack("<HH", data[6:10]))
    for left, top, w, h in frames.gif_frames(data):
        width, height = max(width, left + w), max(height, top + h)
    return width, height


def _bmp(data: bytes) -> tuple[int, int]:
    if struct.unpack("<I", data[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes (review)
        width, height = struct.unpack("<HH", data[18:22])
        return int(width), int(height)
    width, height = struct.unpack("<ii", data[18:26])
    return abs(int(width)), abs(int(height))


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: the frame header after the 3-byte tag and start code
        width, height = struct.unpack("<HH", data[26:30])
        return int(width) & 0x3FFF, int(height) & 0x3FFF
    if chunk == b"VP8L":  # lossless: 14 bits each, minus one, after the signature byte
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: 24-bit canvas size, minus one
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    return None


def _jpg(data: bytes) -> tuple[int, int] | None:
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return int(width), int(height)
        if marker == 0xDA:  # start of scan before any frame header: not a JPEG we can read
            return None
        pos += 2 + int(length)
    return None


_READERS = {"png": _png, "gif": _gif, "bmp": _bmp, "webp": _webp, "jpg": _jpg}
