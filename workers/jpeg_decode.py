"""JPEG on the CPU through libjpeg-turbo's TurboJPEG API (simplejpeg), told to stop at a warning.

torchvision's and PIL's libjpeg decoders hear libjpeg's warnings and go on: a JPEG cut short and given
an end marker decoded with its missing rows grey, and a flipped bit in the entropy-coded data decoded
as garbled blocks, each reported as success (torchvision printed the warning to stderr, PIL to
nowhere). TurboJPEG stops at the first warning and says which, so a warning that means pixels are
missing or wrong fails the job, with libjpeg's own words. The pixels are the same as torchvision's
and PIL's (tests/unit/test_jpeg_decode.py compares them), and a 12 MP photo decodes as fast or faster.

A warning in the header (bytes between its segments, a JFIF version other than 1) stops TurboJPEG
before any pixel, also when not told to stop: the header is cleaned of both, as libjpeg reads past
them, and the copy decoded strictly, so such a file's scans are still checked (review, helper-94:
it went to PIL, which decoded a cut one grey). No other decoder is tried for a file TurboJPEG
refuses, but for one whose header only warns of something the pixels do not depend on.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from shared.errors import ImageDecodeError

if TYPE_CHECKING:
    import numpy as np

# libjpeg's warnings (jerror.h) that mean pixels are missing or wrong: JWRN_HIT_MARKER, JWRN_JPEG_EOF,
# JWRN_HUFF_BAD_CODE, JWRN_ARITH_BAD_CODE, JWRN_MUST_RESYNC, JWRN_BOGUS_PROGRESSION; and, once the
# header is clean, bytes left over before any marker but the end (JWRN_EXTRANEOUS_DATA): a scan that
# ended early or was overrun (in a progressive file or one with restart markers, its usual sign).
_PIXELS_LOST = (
    "premature end of data segment",
    "premature end of jpeg file",
    "bad huffman code",
    "bad arithmetic code",
    "instead of rst",
    "inconsistent progression sequence",
    "extraneous bytes before marker",
)
# A few bytes before the end marker: some cameras pad there, and every scan was read (decoded anyway).
# More is a scan that ended before its data did: a changed byte made the rest of it read as codes
# (296 single-byte changes in one photo left 30 to 377 such bytes; a camera's padding, 1 or 2).
_PADDED = re.compile(r"(\d+) extraneous bytes before marker 0xd9")
_PADDING_AT_MOST = 16
# Header warnings TurboJPEG stops at even when not told to, that no pixel depends on: PIL decodes
# those files (its libjpeg goes on), as it did every JPEG before.
_HEADER_ONLY = ("thumbnail image size", "adobe color transform", "invalid sos parameters for sequential")
_CMYK = frozenset({"CMYK", "YCCK"})


def decode(data: bytes) -> np.ndarray | None:
    """The image as uint8 RGB, height × width × 3. ImageDecodeError where libjpeg says pixels are
    missing or corrupt, or cannot read it at all; None where only a header warning stops TurboJPEG,
    for PIL to decode."""
    try:
        return _strict(data)
    except ValueError as exc:
        said = str(exc)
    cleaned = _clean_header(data)
    if cleaned != data:
        try:
            return _strict(cleaned)
        except ValueError as exc:
            said = str(exc)  # the cleaned file's own first warning
    lowered = said.lower()
    padded = _PADDED.search(lowered)
    if padded and int(padded.group(1)) <= _PADDING_AT_MOST:
        return _lenient(cleaned, said)
    if any(header in lowered for header in _HEADER_ONLY):
        return None
    # A warning that pixels are lost, or an error libjpeg cannot go past (a bogus table or marker
    # length, an unsupported process): no other decoder reads it better (PIL's is libjpeg too).
    raise ImageDecodeError(f"jpg data is corrupt or truncated: {said}")


def _strict(data: bytes) -> np.ndarray:
    import simplejpeg

    colorspace = simplejpeg.decode_jpeg_header(data)[2]
    space = "CMYK" if colorspace in _CMYK else "RGB"
    pixels = simplejpeg.decode_jpeg(data, colorspace=space, strict=True)
    return _cmyk_to_rgb(pixels) if space == "CMYK" else pixels


def _lenient(data: bytes, said: str) -> np.ndarray:
    """The whole file decoded past a warning that leaves the pixels whole."""
    import simplejpeg

    try:
        colorspace = simplejpeg.decode_jpeg_header(data)[2]
        space = "CMYK" if colorspace in _CMYK else "RGB"
        pixels = simplejpeg.decode_jpeg(data, colorspace=space, strict=False)
    except ValueError as exc:
        raise ImageDecodeError(f"jpg data is corrupt or truncated: {said}; then {exc}") from None
    return _cmyk_to_rgb(pixels) if space == "CMYK" else pixels


def _clean_header(data: bytes) -> bytes:
    """The file with its header's segments as libjpeg reads them: bytes between segments dropped (it
    skips them, warning), a JFIF major version other than 1 set to 1 (it warns, and reads on). The
    scans, from the first start-of-scan on, are left as they are. The file itself where its header
    is not whole (the decoder then says what is wrong)."""
    if not data.startswith(b"\xff\xd8"):
        return data
    out, at = bytearray(b"\xff\xd8"), 2
    while at < len(data):
        if data[at] != 0xFF:
            at += 1  # a byte between segments
            continue
        while at < len(data) and data[at] == 0xFF:
            at += 1  # fill bytes
        if at + 3 > len(data):
            return data
        marker, length = data[at], int.from_bytes(data[at + 1 : at + 3], "big")
        if marker == 0x00 or 0xD0 <= marker <= 0xD9 or length < 2:  # no segment here: left to libjpeg
            return data
        segment = bytearray(data[at + 1 : at + 1 + length])
        if marker == 0xE0 and segment[2:7] == b"JFIF\0" and len(segment) > 7 and segment[7] != 1:
            segment[7] = 1
        out += bytes([0xFF, marker]) + segment
        at += 1 + length
        if marker == 0xDA:  # start of scan: the rest is the image's data
            return bytes(out + data[at:])
    return data


def _cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    """PIL's conversion exactly (and torchvision's): each of C, M, Y times K over 255, rounded, in the
    integer form PIL uses (MULDIV255). The product and its sum fit 16 bits."""
    import numpy as np

    wide = cmyk.astype(np.uint16)
    product = wide[..., :3] * wide[..., 3:4] + 128
    return (((product >> 8) + product) >> 8).astype(np.uint8)
