"""JPEG on the CPU: the same pixels as PIL (the processor's decoder) and torchvision, and a refusal
where libjpeg says pixels are missing or wrong, which both of those decode grey or garbled."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shared.errors import ImageDecodeError
from tests.support import imagegen
from workers import images, jpeg_decode, jpeg_scans

LIMIT = 40_000_000


def _jpeg(img: Image.Image, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", **kw)
    return out.getvalue()


def _noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode)
    pixels = rng.integers(0, 256, (height, width, bands), np.uint8)
    return Image.frombytes(mode, (width, height), pixels.tobytes())


def _pil_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _scan_bounds(data: bytes) -> tuple[int, int]:
    """Where the first scan's entropy-coded data starts and where the end marker is."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big"), len(data) - 2


def _without_adobe_marker(data: bytes) -> bytes:
    at = data.index(b"\xff\xee")
    return data[:at] + data[at + 2 + int.from_bytes(data[at + 2 : at + 4], "big") :]


CMYK = _jpeg(_noise(64, 48, "CMYK", seed=3), quality=100)
CLEAN = {
    "4:2:0": _jpeg(_noise(161, 99), quality=90),
    "4:2:2": _jpeg(_noise(161, 99), quality=75, subsampling=1),
    "4:4:4": _jpeg(_noise(33, 17), quality=95, subsampling=0),
    "progressive": _jpeg(_noise(120, 81), quality=50, progressive=True),
    "optimised": _jpeg(_noise(64, 64), optimize=True),
    "restart markers": _jpeg(_noise(200, 100), restart_marker_blocks=1),
    "grey": _jpeg(_noise(70, 50, "L")),
    "1x1": _jpeg(_noise(1, 1)),
    "cmyk (Adobe)": CMYK,
    "cmyk (no Adobe marker)": _without_adobe_marker(CMYK),
    "camera photo": imagegen.camera_photo(320, 240),
}


@pytest.mark.parametrize("kind", list(CLEAN))
def test_a_whole_jpeg_decodes_to_the_processors_pixels(kind: str) -> None:
    data = CLEAN[kind]
    decoded = images.load(data, LIMIT).tensor
    assert decoded.dtype == torch.uint8
    assert decoded.shape[0] == 3
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(data))


def test_the_pixels_lie_pixel_by_pixel_as_the_preprocessing_wants() -> None:
    assert images.load(CLEAN["4:2:0"], LIMIT).tensor.permute(1, 2, 0).is_contiguous()


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_a_jpeg_cut_short_is_refused_with_or_without_an_end_marker(
    fraction: float, progressive: bool
) -> None:
    """Before: a cut JPEG given an end marker decoded, its missing rows grey (128, 128, 128), and the
    model answered about that picture. libjpeg only warned, to stderr."""
    data = _jpeg(_noise(160, 120), quality=90, progressive=progressive)
    cut = data[: int(len(data) * fraction)]
    ended = (cut + b"\xff\xd9", "premature end of data segment")
    for damaged, said in (ended, (cut, "Premature end of JPEG file")):
        with pytest.raises(ImageDecodeError, match="jpg data is corrupt or truncated") as refused:
            images.load(damaged, LIMIT)
        assert said in str(refused.value)


def test_a_marker_inside_the_scan_and_a_bad_huffman_code_are_refused() -> None:
    data = CLEAN["camera photo"]
    start, end = _scan_bounds(data)
    middle = (start + end) // 2
    marker, bad_code = (b"\xff\xd3", "premature end of data segment"), (b"\xff\x00" * 40, "bad Huffman code")
    for inserted, said in (marker, bad_code):
        with pytest.raises(ImageDecodeError, match=said):
            images.load(data[:middle] + inserted + data[middle:], LIMIT)


def test_a_cmyk_jpeg_cut_short_is_refused_too() -> None:
    with pytest.raises(ImageDecodeError, match="premature end of data segment"):
        images.load(CMYK[: len(CMYK) // 2] + b"\xff\xd9", LIMIT)


def test_extraneous_bytes_before_the_end_marker_leave_the_photo_whole() -> None:
    """Some cameras pad before the end marker and libjpeg warns of it; the pixels are all there, so the
    photo is decoded, not refused."""
    data = CLEAN["camera photo"]
    padded = data[:-2] + b"\x00\x00\x00" + data[-2:]
    decoded = images.load(padded, LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(data))


def test_what_libjpeg_cannot_read_is_refused_in_its_words() -> None:
    """Review, helper-94: an error libjpeg cannot read past went to PIL, which decoded what it could of
    the file (garbled). One in the header TurboJPEG reports as a layout it cannot name; PIL, whose
    libjpeg stops there too, names it."""
    data = bytearray(CLEAN["camera photo"])
    table = data.index(b"\xff\xc4")
    data[table + 5 : table + 21] = b"\xff" * 16  # its code counts: more codes than a table has
    with pytest.raises(ImageDecodeError, match="jpg data is corrupt or truncated"):
        images.load(bytes(data), LIMIT)
    whole = CLEAN["progressive"]
    sos = [at for at in range(len(whole) - 1) if whole[at : at + 2] == b"\xff\xda"][2]
    bogus = whole[: sos + 2] + b"\x00\x01" + whole[sos + 4 :]  # a later scan's header: length 1
    with pytest.raises(ImageDecodeError, match="jpg data is corrupt or truncated: Bogus marker length"):
        images.load(bogus, LIMIT)
    assert jpeg_decode.decode(b"\xff\xd8\xff\xe0 not a jpeg after all") is None  # PIL names it:
    with pytest.raises(ImageDecodeError):
        images.load(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 40, LIMIT)


def _header_variants(data: bytes) -> dict[str, bytes]:
    sos = data.index(b"\xff\xda")
    return {
        "a byte before its start of scan": data[:sos] + b"\x00" + data[sos:],
        "a byte before its quantisation tables": data.replace(b"\xff\xdb", b"\x00\xff\xdb", 1),
        "JFIF 2.01": data.replace(b"JFIF\x00\x01\x01", b"JFIF\x00\x02\x01", 1),
    }


@pytest.mark.parametrize("kind", list(_header_variants(CLEAN["camera photo"])))
def test_a_header_libjpeg_reads_past_is_decoded_and_its_scans_still_checked(kind: str) -> None:
    """Review, helper-94: a header warning stopped TurboJPEG even when not told to, and the file went
    to PIL, which decoded a cut one with grey rows. The header is cleaned as libjpeg reads it."""
    whole = CLEAN["camera photo"]
    decoded = images.load(_header_variants(whole)[kind], LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(whole))
    cut = whole[: len(whole) // 2] + b"\xff\xd9"
    with pytest.raises(ImageDecodeError, match="premature end of data segment"):
        images.load(_header_variants(cut)[kind], LIMIT)


@pytest.mark.parametrize("layout", [{"progressive": True}, {"restart_marker_blocks": 4}])
def test_a_scan_overrun_in_a_progressive_or_restart_marked_file_is_refused(layout: dict[str, object]) -> None:
    """Review, helper-94: zeroed bytes in such a scan left "extraneous bytes before marker 0xc4" (or a
    restart marker), taken for harmless, and 32-104 of 120 rows decoded garbled."""
    y, x = np.mgrid[0:120, 0:160]
    smooth = np.stack([x * 255 // 159, y * 255 // 119, (x + y) % 256], -1).astype(np.uint8)
    data = _jpeg(Image.fromarray(smooth), quality=85, **layout)
    start, _end = _scan_bounds(data)
    zeroed = data[: start + 147] + bytes(32) + data[start + 179 :]
    with pytest.raises(ImageDecodeError, match="extraneous bytes before marker"):
        images.load(zeroed, LIMIT)


def test_a_scan_that_ends_long_before_its_data_is_refused() -> None:
    """A changed byte made the rest of the scan read as codes: hundreds of bytes left before the end
    marker, where a camera's padding is one or two."""
    data = CLEAN["camera photo"]
    with pytest.raises(ImageDecodeError, match="64 extraneous bytes before marker 0xd9"):
        images.load(data[:-2] + bytes(65) + data[-2:], LIMIT)


def _odd_headers(data: bytes) -> dict[str, bytes]:
    sos = data.index(b"\xff\xda")
    odd_scan = bytearray(data)
    odd_scan[sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big") - 3] = 62  # its spectral end
    adobe = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x03"  # transform 3: not one libjpeg knows
    return {"sequential scan fields": bytes(odd_scan), "Adobe transform 3": data[:2] + adobe + data[2:]}


@pytest.mark.parametrize("kind", list(_odd_headers(CLEAN["camera photo"])))
def test_header_fields_libjpeg_reads_past_are_set_as_it_reads_them(kind: str) -> None:
    """Review, helper-95: "Invalid SOS parameters for sequential JPEG" and "Unknown Adobe color
    transform code" sent the file to PIL, which decoded a cut one grey (83 of 99 rows)."""
    whole = CLEAN["camera photo"]
    decoded = images.load(_odd_headers(whole)[kind], LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(_odd_headers(whole)[kind]))
    cut = whole[: len(whole) // 2] + b"\xff\xd9"
    with pytest.raises(ImageDecodeError, match="premature end of data segment"):
        images.load(_odd_headers(cut)[kind], LIMIT)


@pytest.mark.parametrize(
    "sampling",
    [[(1, 3), (1, 1), (1, 1)], [(1, 4), (1, 1), (1, 1)], [(1, 1), (2, 2), (2, 2)], [(2, 1), (1, 2), (1, 1)]],
    ids=["luma 1x3", "luma 1x4 (4:4:1)", "chroma larger than luma", "mixed"],
)
def test_a_sampling_layout_turbojpeg_does_not_name_is_decoded_by_pil(sampling: list[tuple[int, int]]) -> None:
    """Review, helper-95: "Could not determine subsampling level" refused valid photos (and 4:4:1
    raised a KeyError past images.load); before, torchvision decoded them. PIL does now."""
    data = imagegen.jpeg_sampled(31, 17, sampling)
    assert jpeg_decode.decode(data) is None
    decoded = images.load(data, LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(data))


def test_cmyk_to_rgb_is_pils_rounding_for_every_pair_of_values() -> None:
    values = np.arange(256, dtype=np.uint8)
    c, k = np.meshgrid(values, values, indexing="ij")
    cmyk = np.stack([c, c, c, k], axis=-1)
    expected = (c.astype(np.uint32) * k + 127) // 255  # C·K/255 rounded to nearest
    assert np.array_equal(jpeg_decode._cmyk_to_rgb(cmyk)[..., 0], expected.astype(np.uint8))


def _scan_starts(data: bytes) -> list[int]:
    return [at for at in range(len(data) - 1) if data[at : at + 2] == b"\xff\xda"]


@pytest.mark.parametrize(
    "whole",
    [
        _jpeg(_noise(96, 64), quality=85, progressive=True),
        _jpeg(_noise(96, 64), quality=85, progressive=True, subsampling=0),
        _jpeg(_noise(70, 50, "L"), progressive=True),
        _jpeg(_noise(64, 48, "CMYK", seed=3), progressive=True),
    ],
    ids=["4:2:0", "4:4:4", "grey", "cmyk"],
)
def test_a_progressive_jpeg_cut_at_a_scans_end_is_refused(whole: bytes) -> None:
    """A progressive file cut where a scan ends and given an end marker decoded without one warning
    from libjpeg, TurboJPEG or PIL: the coefficients no scan sent were zero, and the model was told
    about a blurred photo, or one with its colours flat. Every cut is refused now, naming what the
    scans never sent; the whole file decodes as before."""
    assert np.array_equal(images.load(whole, LIMIT).tensor.permute(1, 2, 0).numpy(), _pil_rgb(whole))
    for start in _scan_starts(whole)[1:]:
        cut = whole[:start] + b"\xff\xd9"
        _pil_rgb(cut)  # no decoder before said a word
        with pytest.raises(ImageDecodeError, match=r"its scans never send component \d's coefficients"):
            images.load(cut, LIMIT)


def test_the_scans_are_read_past_segments_that_hold_marker_bytes() -> None:
    """A thumbnail in APP1 and a comment between scans carry bytes that look like scan headers: they are
    skipped by their lengths, as libjpeg skips them."""
    whole = _jpeg(_noise(96, 64), progressive=True)
    thumbnail = _jpeg(_noise(16, 16))  # a whole sequential JPEG, its own start of scan inside
    app1 = b"\xff\xe1" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail
    comment = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"  # a whole scan's header, as a comment's text
    com = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
    last = _scan_starts(whole)[-1]
    wrapped = whole[:2] + app1 + whole[2:last] + com + whole[last:]
    assert jpeg_scans.progression_gap(wrapped) is None
    decoded = images.load(wrapped, LIMIT).tensor
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), _pil_rgb(whole))
    cut = whole[:2] + app1 + whole[2:last] + com + b"\xff\xd9"
    assert jpeg_scans.progression_gap(cut) == "its scans never send component 1's coefficients 1-63"


def test_a_sequential_jpeg_is_not_read_for_scans() -> None:
    assert jpeg_scans.progression_gap(CLEAN["camera photo"]) is None
    assert jpeg_scans.progression_gap(b"\xff\xd8\xff\xe0\x00\x40 a header cut short") is None


def test_a_progressive_jpeg_of_more_scans_than_any_encoder_sends_is_refused_at_once() -> None:
    """Review, helper-100: millions of tiny scans (a crafted file TurboJPEG refuses, nvjpeg may not) held
    the scans' read 10 s; past 4,096 scans it stops and refuses."""
    whole = _jpeg(_noise(96, 64), progressive=True)
    last = _scan_starts(whole)[-1]
    scan = whole[last:-2]  # the last scan (a refinement of luma's AC, Al 0): header and data
    crafted = whole[:last] + scan * 5000 + b"\xff\xd9"
    assert jpeg_scans.progression_gap(crafted) == "it holds more than 4096 scans"
    assert jpeg_scans.progression_gap(whole[:last] + scan * 3 + b"\xff\xd9") is None


@pytest.mark.parametrize("filler", [b"\xff\xfe\x00\x02", b"\xff\x01"], ids=["empty comments", "TEM markers"])
def test_millions_of_empty_markers_between_scans_are_refused_at_once(filler: bytes) -> None:
    """Review, helper-101: the scan cap counted scans only; 8 million empty comments before the second
    scan took the read 7 s, and the file was accepted."""
    whole = _jpeg(_noise(96, 64), progressive=True)
    second = _scan_starts(whole)[1]
    crafted = whole[:second] + filler * 20_000 + whole[second:]
    assert jpeg_scans.progression_gap(crafted) == "it holds more than 16384 markers"
    # Refused as past a bound, not called corrupt (review, helper-102: PIL decodes such a file)
    with pytest.raises(ImageDecodeError, match=r"^jpg refused: it holds more than 16384 markers$"):
        images.load(crafted, LIMIT)
    assert jpeg_scans.progression_gap(whole[:second] + filler * 100 + whole[second:]) is None
