"""JPEG on the CPU through libjpeg-turbo's TurboJPEG API (simplejpeg), told to stop at a warning.

torchvision's and PIL's libjpeg decoders hear libjpeg's warnings and go on: a JPEG cut short and given
an end marker decoded with its missing rows grey, and a flipped bit in the entropy-coded data decoded
as garbled blocks, each reported as success (torchvision printed the warning to stderr, PIL to
nowhere). TurboJPEG stops at the first warning and says which, so a warning that means pixels are
missing or wrong fails the job, with libjpeg's own words. The pixels are the same as torchvision's
and PIL's (tests/unit/test_jpeg_decode.py compares them), and a 12 MP photo decodes as fast or faster.

A warning in the header (bytes between its segments, a JFIF version other than 1, an Adobe colour
transform or sequential scan fields libjpeg does not know) stops TurboJPEG before any pixel, also
when not told to stop: the header is cleaned of them as libjpeg reads past them, and the copy
decoded strictly, so such a file's scans are still checked (reviews, helper-94 and helper-95: it
went to PIL, which decoded a cut one grey). No other decoder is tried for a file TurboJPEG
refuses, but for a sampling layout TurboJPEG's API has no name for.
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
# TurboJPEG's API names a few sampling layouts and refuses the others (luma 1x3, chroma larger than
# luma...), which libjpeg and PIL decode; simplejpeg has no name for one it knows (4:4:1, a KeyError).
# PIL decodes those, unchecked: the one gap left in the check (review, helper-95). TurboJPEG says the
# same of a header libjpeg cannot read at all; PIL's libjpeg stops there too, and PIL names it.
_NO_LAYOUT = "could not determine subsampling level"
_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_CMYK = frozenset({"CMYK", "YCCK"})


def decode(data: bytes) -> np.ndarray | None:
    """The image as uint8 RGB, height × width × 3. ImageDecodeError where libjpeg says pixels are
    missing or corrupt, or cannot read it at all; None for a sampling layout TurboJPEG's API does not
    take, for PIL to decode."""
    try:
        return _strict(data)
    except ValueError as exc:
        said = str(exc)
    except KeyError:
        return None  # a sampling layout simplejpeg has no name for
    cleaned = _clean_header(data)
    if cleaned != data:
        try:
            return _strict(cleaned)
        except ValueError as exc:
            said = str(exc)  # the cleaned file's own first warning
        except KeyError:
            return None
    lowered = said.lower()
    padded = _PADDED.search(lowered)
    if padded and int(padded.group(1)) <= _PADDING_AT_MOST:
        return _lenient(cleaned, said)
    if _NO_LAYOUT in lowered:
        return None  # PIL decodes it, or names what is wrong (garbage gets this message too)
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
    """The file with its header as libjpeg reads it, so that no header warning stops TurboJPEG before
    the scans: bytes between segments dropped (libjpeg skips them); a JFIF major version other than 1
    set to 1; an Adobe colour transform libjpeg does not know set to the one it then assumes (YCbCr
    for three components, YCCK for four); a sequential scan's spectral and approximation fields set
    to the only ones a sequential scan has (libjpeg ignores them). Each is a warning libjpeg reads on
    from, as PIL does. The scans, from the first start-of-scan on, are left as they are; the file
    itself where its header is not whole (the decoder then says what is wrong)."""
    parsed = _header_segments(data)
    if parsed is None:
        return data
    segments, scans = parsed
    frames = [(marker, segment) for marker, segment in segments if marker in _FRAMES]
    kind, frame = frames[0] if frames else (0, bytearray())
    components = frame[7] if len(frame) > 7 else 0
    sequential = kind in (0xC0, 0xC1)  # baseline, extended: not progressive, not lossless
    out = bytearray(b"\xff\xd8")
    for marker, segment in segments:
        if marker == 0xE0 and segment[2:7] == b"JFIF\0" and len(segment) > 7 and segment[7] != 1:
            segment[7] = 1
        if marker == 0xEE and segment[2:7] == b"Adobe" and len(segment) > 13:
            known = {3: (0, 1), 4: (0, 2)}.get(components, (segment[13],))
            if segment[13] not in known:
                segment[13] = known[-1]
        if marker == 0xDA and sequential and len(segment) >= 6:
            segment[-3:] = b"\x00\x3f\x00"  # Ss 0, Se 63, Ah and Al 0
        out += bytes([0xFF, marker]) + segment
    return bytes(out + scans)


def _header_segments(data: bytes) -> tuple[list[tuple[int, bytearray]], bytes] | None:
    """The header's segments up to and with the first start-of-scan (marker, length and payload),
    as libjpeg finds them (skipping other bytes, FF 00 among them, and fill bytes), and the rest of
    the file; None where the header is not whole or not what a header holds."""
    if not data.startswith(b"\xff\xd8"):
        return None
    segments: list[tuple[int, bytearray]] = []
    at = 2
    while at < len(data):
        if data[at] != 0xFF:
            at += 1  # a byte between segments
            continue
        while at < len(data) and data[at] == 0xFF:
            at += 1  # fill bytes
        if at < len(data) and data[at] == 0x00:
            at += 1  # FF 00 between segments: libjpeg skips it too
            continue
        if at + 3 > len(data):
            return None
        marker, length = data[at], int.from_bytes(data[at + 1 : at + 3], "big")
        if 0xD0 <= marker <= 0xD9 or marker == 0x01 or length < 2 or at + 1 + length > len(data):
            return None  # no segment here: left to libjpeg
        segments.append((marker, bytearray(data[at + 1 : at + 1 + length])))
        at += 1 + length
        if marker == 0xDA:  # start of scan: the rest is the image's data
            return segments, data[at:]
    return None


def _cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    """PIL's conversion exactly (and torchvision's): each of C, M, Y times K over 255, rounded, in the
    integer form PIL uses (MULDIV255). The product and its sum fit 16 bits."""
    import numpy as np

    wide = cmyk.astype(np.uint16)
    product = wide[..., :3] * wide[..., 3:4] + 128
    return (((product >> 8) + product) >> 8).astype(np.uint8)
