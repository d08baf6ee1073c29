"""JPEG on the CPU through libjpeg-turbo's TurboJPEG API (simplejpeg), told to stop at a warning.

torchvision's and PIL's libjpeg decoders hear libjpeg's warnings and go on: a JPEG cut short and given
an end marker decoded with its missing rows grey, and a flipped bit in the entropy-coded data decoded
as garbled blocks, each reported as success (torchvision printed the warning to stderr, PIL to
nowhere). TurboJPEG stops at the first warning and says which, so a warning that means pixels are
missing or wrong fails the job, with libjpeg's own words. The pixels are the same as torchvision's
and PIL's (tests/unit/test_jpeg_decode.py compares them), and a 12 MP photo decodes as fast or faster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import ImageDecodeError

if TYPE_CHECKING:
    import numpy as np

# libjpeg's warnings (jerror.h) that mean pixels are missing or wrong: JWRN_HIT_MARKER, JWRN_JPEG_EOF,
# JWRN_HUFF_BAD_CODE, JWRN_ARITH_BAD_CODE, JWRN_MUST_RESYNC, JWRN_BOGUS_PROGRESSION. The others leave
# the pixels whole (extraneous bytes before a marker, which some cameras write before the end marker;
# an unknown JFIF revision; a bad ICC marker) and must not fail a photo that decodes right.
_PIXELS_LOST = (
    "premature end of data segment",
    "premature end of jpeg file",
    "bad huffman code",
    "bad arithmetic code",
    "instead of rst",
    "inconsistent progression sequence",
)
_CMYK = frozenset({"CMYK", "YCCK"})


def decode(data: bytes) -> np.ndarray | None:
    """The image as uint8 RGB, height × width × 3. ImageDecodeError where libjpeg warns that pixels are
    missing or corrupt; None where TurboJPEG cannot decode it at all (a 12-bit or lossless JPEG, say),
    for another decoder to try or to name the fault."""
    import simplejpeg

    try:
        colorspace = simplejpeg.decode_jpeg_header(data)[2]
    except ValueError:
        return None
    space = "CMYK" if colorspace in _CMYK else "RGB"
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace=space, strict=True)
    except ValueError as exc:
        said = str(exc)
        if any(lost in said.lower() for lost in _PIXELS_LOST):
            raise ImageDecodeError(f"jpg data is corrupt or truncated: {said}") from None
        try:  # a warning that leaves the pixels whole stopped the strict decode
            pixels = simplejpeg.decode_jpeg(data, colorspace=space, strict=False)
        except ValueError:
            return None
    return _cmyk_to_rgb(pixels) if space == "CMYK" else pixels


def _cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    """PIL's conversion exactly (and torchvision's): each of C, M, Y times K over 255, rounded, in the
    integer form PIL uses (MULDIV255). The product and its sum fit 16 bits."""
    import numpy as np

    wide = cmyk.astype(np.uint16)
    product = wide[..., :3] * wide[..., 3:4] + 128
    return (((product >> 8) + product) >> 8).astype(np.uint8)
