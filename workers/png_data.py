"""Whether a PNG's pixel data covers its whole image.

A PNG whose compressed pixel stream (its IDAT chunks) ends cleanly but early, a zlib stream that
says "done" after half the rows, decodes in PIL without a word: the rows never written stay black,
and the model answers about a picture that is half missing. PIL's decoder stops at the stream's end
and reports success; only counting what the stream inflates to tells. torchvision's libpng path,
which would say "Not enough image data", kills the process on the same file (images.py keeps PNG
off it). Pure Python over bytes (zlib), so it runs in a decode thread without the GIL held while
it inflates.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
# Adam7's seven passes: first column, first row, column step, row step.
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PIECE = 1 << 20  # inflate at most this much at a time: the count needs no copy of the pixels


def shortfall(data: bytes) -> str | None:
    """Words for what is missing when the pixel data inflates to fewer bytes than the header's size
    needs; None when it covers the image, or when the file is not a PNG this can read (the decoder
    names those faults itself)."""
    header = _header(data)
    if header is None:
        return None
    width, height, depth, colour, interlaced = header
    if colour not in _CHANNELS:
        return None
    needed = needed_bytes(width, height, depth * _CHANNELS[colour], interlaced)
    held = _inflated_size(_idat(data), needed)
    if held is None or held >= needed:
        return None
    if interlaced:
        return f"its pixel data holds {held} of the {needed} bytes its {width}x{height} header needs"
    rows = held // _row_bytes(width, depth * _CHANNELS[colour])
    return f"its pixel data stops after row {rows} of {height}"


def frame_problem(data: bytes) -> str | None:
    """Words for an animated PNG whose default image's frame (an fcTL before the first IDAT) is not the
    whole image, as the APNG spec requires it to be: PIL decodes only that rectangle of the pixel
    data and leaves the rest of the picture black (review, helper-88). None when it is whole, or when
    the default image is not a frame (then the first frame is drawn on an empty canvas, as specified)."""
    header = _header(data)
    if header is None:
        return None
    width, height = header[0], header[1]
    for kind, body in _chunks_before_pixels(data):
        if kind == b"fcTL" and len(body) >= 20:
            frame_w, frame_h, x, y = struct.unpack(">IIII", body[4:20])
            if (frame_w, frame_h, x, y) != (width, height, 0, 0):
                return f"its first frame is {frame_w}x{frame_h} at ({x}, {y}); the image is {width}x{height}"
            return None
    return None


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


def _header(data: bytes) -> tuple[int, int, int, int, bool] | None:
    """IHDR's width, height, bit depth, colour type and interlace flag."""
    if not data.startswith(_SIGNATURE) or len(data) < 33 or data[12:16] != b"IHDR":
        return None
    width, height, depth, colour, _compression, _filter, interlace = struct.unpack(">IIBBBBB", data[16:29])
    return (
        width,
        height,
        depth,
        colour,
        interlace != 0,
    )  # PIL reads any other byte as Adam7 (review, helper-88)


def _chunks_before_pixels(data: bytes) -> Iterator[tuple[bytes, memoryview]]:
    """Each chunk's type and body up to the first IDAT (a few, however large the image)."""
    view = memoryview(data)
    pos = len(_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind in (b"IDAT", b"IEND"):
            return
        yield kind, view[pos + 8 : pos + 8 + length]
        pos += 12 + length


def _idat(data: bytes) -> Iterator[memoryview]:
    """The IDAT chunks' payloads in file order (a chunk cut short gives what is there)."""
    view = memoryview(data)
    pos = len(_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IDAT":
            yield view[pos + 8 : pos + 8 + length]
        elif kind == b"IEND":
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
