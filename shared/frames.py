"""How many frames an image file holds, read from its container structure without decoding anything.

An animated image is a bomb in a small file: a few KB of GIF can hold hundreds of frames on a large
canvas, and a decoder that draws every frame spends canvas x frames of memory. The worker bounds
frames x pixels with this count before it decodes, and then decodes the first frame only. Pure
Python over bytes (no PIL, no torch), so the producer side can use it as well.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator


def frame_count(data: bytes, fmt: str) -> int:
    """Frames in a GIF, APNG or animated WebP (1 for a still image or any other format)."""
    counter = _COUNTERS.get(fmt)
    return max(1, counter(data)) if counter else 1


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """Past a GIF sub-block chain (length-prefixed blocks ending with a zero length)."""
    while pos < len(data):
        size = data[pos]
        pos += 1
        if size == 0:
            break
        pos += size
    return pos


def _color_table_size(flags: int) -> int:
    return 3 * (2 ** ((flags & 0x07) + 1)) if flags & 0x80 else 0


def gif_frames(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """Each frame's (left, top, width, height), from its image descriptor; a descriptor cut short
    still counts, as (0, 0, 0, 0)."""
    if len(data) < 13:
        return
    pos = 13 + _color_table_size(data[10])
    while pos < len(data):
        block = data[pos]
        if block == 0x2C:  # image descriptor: one frame
            if pos + 10 > len(data):
                yield 0, 0, 0, 0
                return
            left, top, width, height = struct.unpack("<HHHH", data[pos + 1 : pos + 9])
            yield int(left), int(top), int(width), int(height)
            pos += 10 + _color_table_size(data[pos + 9]) + 1  # + LZW minimum code size
            pos = _skip_sub_blocks(data, pos)
        elif block == 0x21:  # extension: label, then sub-blocks
            pos = _skip_sub_blocks(data, pos + 2)
        else:  # trailer (0x3B) or garbage: nothing after it is drawn
            return


def _gif_frames(data: bytes) -> int:
    return sum(1 for _frame in gif_frames(data)) if len(data) >= 13 else 1


def _png_frames(data: bytes) -> int:
    """APNG: the larger of the frame count acTL claims and the fcTL chunks present."""
    pos, claimed, controls = 8, 0, 0
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"acTL" and length >= 8 and pos + 12 <= len(data):
            claimed = struct.unpack(">I", data[pos + 8 : pos + 12])[0]
        elif kind == b"fcTL":
            controls += 1
        elif kind == b"IEND":
            break
        pos += 12 + length
    return max(claimed, controls)


def _webp_frames(data: bytes) -> int:
    pos, frames = 12, 0
    while pos + 8 <= len(data):
        kind, length = struct.unpack("<4sI", data[pos : pos + 8])
        if kind == b"ANMF":
            frames += 1
        pos += 8 + length + (length & 1)
    return frames


_COUNTERS = {"gif": _gif_frames, "png": _png_frames, "webp": _webp_frames}
