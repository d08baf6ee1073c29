"""Whether the pixel data PIL decodes from a PNG covers the whole image.

A PNG whose compressed pixel stream ends cleanly but early, a zlib stream that says "done" after half
the rows, decodes in PIL without a word: the rows never written stay black, and the model answers
about a picture that is half missing. PIL's decoder stops at the stream's end and reports success;
only counting what the stream inflates to tells. torchvision's libpng path, which would say "Not
enough image data", kills the process on the same file (images.py keeps PNG off it). Likewise PIL
decodes only the rectangle of an animated PNG's first frame, the rest black.

Both checks read what PIL itself will decode, its tile (the rectangle, where the stream starts and
the raw mode), not a parse of our own: PIL skips chunks before the header, keeps the last of two
headers or frame controls, and may take a frame's data (fdAT) as the default image's, and a parse
that differed from it on any of those was a way past the check (review, helper-89). The count runs
over bytes (zlib), in a decode thread, without the GIL held while it inflates.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

# Adam7's seven passes: first column, first row, column step, row step.
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
# Bits per pixel of each raw mode PIL reads a PNG in (PngImagePlugin's table, by bit depth and colour
# type; tests/unit/test_images.py checks this against it).
BITS = {
    "1": 1, "L;2": 2, "L;4": 4, "L": 8, "I;16B": 16, "RGB": 24, "RGB;16B": 48, "P;1": 1, "P;2": 2,
    "P;4": 4, "P": 8, "LA": 16, "LA;16B": 32, "RGBA": 32, "RGBA;16B": 64,
}  # fmt: skip
_DATA = (b"IDAT", b"DDAT")  # the chunks PIL reads pixel data from, with fdAT (after its sequence number)
_PIECE = 1 << 20  # inflate at most this much at a time: the count needs no copy of the pixels


def frame_problem(size: tuple[int, int], tile: Sequence[Any]) -> str | None:
    """Words for a first frame PIL would draw on part of the image only (an animated PNG's frame
    control says a rectangle; the APNG spec says the default image's must be the whole image); None
    when PIL decodes the whole image."""
    if len(tile) != 1:
        return None
    x0, y0, x1, y1 = (int(v) for v in tile[0][1])
    if (x0, y0, x1, y1) == (0, 0, *size):
        return None
    width, height = size
    return f"its first frame is {x1 - x0}x{y1 - y0} at ({x0}, {y0}); the image is {width}x{height}"


def shortfall(data: bytes, size: tuple[int, int], tile: Sequence[Any], interlaced: bool) -> str | None:
    """Words for what is missing when the stream PIL decodes (from its tile's offset on, through
    the data chunks that follow it) inflates to fewer bytes than the image needs; None when it
    covers the image, or when the tile is not one this can read (PIL names those faults itself)."""
    if len(tile) != 1 or frame_problem(size, tile) is not None:
        return None
    _codec, _extents, offset, rawmode = tile[0][:4]
    bits = BITS.get(rawmode) if isinstance(rawmode, str) else None
    if bits is None:
        return None
    width, height = size
    needed = needed_bytes(width, height, bits, interlaced)
    held = _inflated_size(_stream(data, int(offset)), needed)
    if held is None or held >= needed:
        return None
    if interlaced:
        return f"its pixel data holds {held} of the {needed} bytes its {width}x{height} header needs"
    return f"its pixel data stops after row {held // _row_bytes(width, bits)} of {height}"


def needed_bytes(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> int:
    """The filtered, uncompressed size of an image's pixel data: each row is a filter byte and then
    its pixels; an interlaced image is seven smaller images (an empty pass has no rows at all)."""
    if not interlaced:
        return height * _row_bytes(width, bits_per_pixel)
    total = 0
    for x0, y0, dx, dy in _ADAM7:
        columns = (width - x0 + dx - 1) // dx if width > x0 else 0
        rows = (height - y0 + dy - 1) // dy if height > y0 else 0
        if columns and rows:
            total += rows * _row_bytes(columns, bits_per_pixel)
    return total


def _row_bytes(width: int, bits_per_pixel: int) -> int:
    return 1 + (width * bits_per_pixel + 7) // 8


def _stream(data: bytes, offset: int) -> Iterator[memoryview]:
    """The pixel stream as PIL reads it: from `offset` (in an IDAT, or in an fdAT past its sequence
    number) to the end of that chunk, then each data chunk that directly follows (a chunk cut short
    gives what is there)."""
    if data[offset - 4 : offset] in _DATA:
        pos = offset - 8
    elif data[offset - 8 : offset - 4] == b"fdAT":
        pos = offset - 12
    else:
        return
    view = memoryview(data)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = view[pos + 8 : pos + 8 + length]
        if kind in _DATA:
            yield body
        elif kind == b"fdAT":
            yield body[4:]
        else:
            return
        pos += 12 + length


def _inflated_size(chunks: Iterator[memoryview], needed: int) -> int | None:
    """How many bytes the stream inflates to, counting no further than `needed`; None when the
    stream is not valid zlib (the decoder reports that as corrupt)."""
    inflater = zlib.decompressobj()
    held = 0
    try:
        for chunk in chunks:
            pending: bytes | memoryview = chunk
            while pending and held < needed:
                held += len(inflater.decompress(pending, min(_PIECE, needed - held)))
                pending = inflater.unconsumed_tail
            if held >= needed or inflater.eof:
                return held
    except zlib.error:
        return None
    return held
