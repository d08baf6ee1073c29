from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from shared.errors import (
    ImageDecodeError,
    ImageNotFound,
    ImageSourceForbidden,
    ImageTooLarge,
    UnsupportedImageFormat,
)
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers import images

LIMIT = 40_000_000


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", UnsupportedImageFormat),
        (b"hello, I am text named .jpg", UnsupportedImageFormat),
        (imagegen.truncated_jpeg(), ImageDecodeError),
        (imagegen.png_header_only(60000, 60000), ImageTooLarge),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, ImageDecodeError),
        (b"II*\x00" + b"\x00" * 20, UnsupportedImageFormat),
    ],
)
def test_bad_bytes_raise_the_error_that_names_them(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        images.load(data, LIMIT)


@pytest.mark.parametrize("data", [imagegen.png_header_only(0, 0), imagegen.png_header_only(0, 5)])
def test_an_empty_image_is_refused_in_words_without_the_workers_memory(data: bytes) -> None:
    """Review, helper-73: PIL's "cannot identify image file <_io.BytesIO object at 0x7f...>" went to the
    client whole, an address in the worker's memory with it."""
    with pytest.raises(ImageDecodeError) as refused:
        images.load(data, LIMIT)
    assert refused.value.message.startswith("png header"), refused.value.message
    assert " at 0x" not in refused.value.message
    assert "<" not in refused.value.message


def test_bomb_is_refused_from_the_header() -> None:
    # 60000 x 60000 x 3 bytes would be 10 GB; the check must happen before any decode.
    with pytest.raises(ImageTooLarge, match="60000x60000") as refused:
        images.load(imagegen.png_header_only(60000, 60000), LIMIT)
    assert refused.value.image_size == (60000, 60000)  # the result says so (review, helper-92: 0x0)


def test_an_image_refused_from_its_header_keeps_its_size_as_displayed() -> None:
    img = Image.new("RGB", (300, 100))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: shown 100 wide, 300 high
    with pytest.raises(ImageTooLarge) as refused:
        images.inspect(_encode(img, "JPEG", exif=exif.tobytes()), 20_000)
    assert refused.value.image_size == (100, 300)
    with pytest.raises(ImageTooLarge) as frames:
        images.inspect(imagegen.gif_bomb(200, 100, 150), 20_000 * 100)
    assert frames.value.image_size == (200, 100)


@pytest.mark.parametrize(
    "img",
    [
        Image.new("L", (40, 30), 128),
        Image.new("RGBA", (40, 30), (10, 20, 30, 0)),
        Image.new("CMYK", (40, 30), (0, 50, 100, 0)),
        Image.new("I;16", (40, 30), 40000),
        Image.new("P", (40, 30), 3),
    ],
)
def test_modes_become_rgb(img: Image.Image) -> None:
    fmt = "JPEG" if img.mode in ("L", "CMYK") else "PNG"
    decoded = images.load(_encode(img, fmt), LIMIT)
    assert decoded.tensor.dtype == torch.uint8
    assert decoded.tensor.shape == (3, 30, 40)


def test_exif_orientation_is_applied() -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: a phone photo taken upright
    decoded = images.load(_encode(img, "JPEG", exif=exif.tobytes()), LIMIT)
    assert (decoded.width, decoded.height) == (20, 40)


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    decoded = images.load(out.getvalue(), LIMIT)
    assert decoded.format == "gif"
    assert decoded.tensor[:, 8, 8].tolist()[0] > 200


@pytest.mark.parametrize(
    ("fmt", "mode", "orientation"),
    [
        ("JPEG", "RGB", 1),
        ("JPEG", "L", 1),
        ("JPEG", "RGB", 6),
        ("JPEG", "RGB", 3),
        ("PNG", "RGB", 1),
        ("PNG", "RGBA", 1),
        ("WEBP", "RGB", 1),
        ("GIF", "P", 1),
    ],
)
def test_decoded_photos_keep_their_bytes_pixel_by_pixel(fmt: str, mode: str, orientation: int) -> None:
    """Decoders write pixels one after another (HWC); the CHW tensor keeps those bytes where they are,
    whatever decoded and turned it, so no photo is copied plane by plane, and the resize and the patch
    reorder after it read runs of pixels (docs/benchmarks.md, "Preprocessing")."""
    img = Image.open(io.BytesIO(imagegen.photo(62, 44, fmt="PNG"))).convert(mode)
    extra: dict[str, object] = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        extra["exif"] = exif.tobytes()
    tensor = images.load(_encode(img, fmt, **extra), LIMIT).tensor
    assert tensor.shape[0] == 3
    assert tensor.dtype == torch.uint8
    assert tensor.permute(1, 2, 0).is_contiguous(), tensor.stride()


@pytest.mark.parametrize("size", [(1, 1), (1, 5000), (5000, 1)])
def test_extreme_shapes_decode(size: tuple[int, int]) -> None:
    decoded = images.load(_encode(Image.new("RGB", size), "PNG"), LIMIT)
    assert (decoded.width, decoded.height) == size


def test_fetch_only_from_allowed_buckets() -> None:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/a.jpg", b"data", "image/jpeg")
    sources = {"mrc": ""}
    assert images.fetch(store, "s3://mrc/inputs/a.jpg", sources, 100) == b"data"
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "s3://other/inputs/a.jpg", sources, 100)
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "https://example.com/a.jpg", sources, 100)
    with pytest.raises(ImageNotFound):
        images.fetch(store, "s3://mrc/inputs/missing.jpg", sources, 100)
    with pytest.raises(ImageTooLarge):
        images.fetch(store, "s3://mrc/inputs/a.jpg", sources, 3)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://mrc/../other-bucket/key.jpg",
        "s3://mrc/inputs/../../other/key.jpg",
        "s3://mrc/inputs/./a.jpg",
        "s3://mrc/inputs//a.jpg",  # a store that folds `//` reads inputs/a.jpg
        "s3://mrc//inputs/a.jpg",
        "s3://mrc/inputs/..",
        "s3://MRC/inputs/a.jpg",
        "s3://mrc/inputs/a\x00.jpg",
    ],
)
def test_keys_that_could_escape_their_bucket_are_refused(uri: str) -> None:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/a.jpg", b"data", "image/jpeg")
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, uri, {"mrc": ""}, 100)


def test_the_bucket_prefix_bounds_reads_in_our_own_bucket() -> None:
    from shared.settings import Settings

    store = MemoryStore("mrc")
    store.put_bytes("tenant-a/inputs/a.jpg", b"data", "image/jpeg")
    store.put_bytes("tenant-b/inputs/b.jpg", b"data", "image/jpeg")
    sources = Settings(s3_prefix="tenant-a", allowed_buckets=["photos"]).image_sources
    assert sources == {"mrc": "tenant-a/", "photos": ""}
    assert images.fetch(store, "s3://mrc/tenant-a/inputs/a.jpg", sources, 100) == b"data"
    with pytest.raises(ImageSourceForbidden):
        images.fetch(store, "s3://mrc/tenant-b/inputs/b.jpg", sources, 100)


def _animation(fmt: str, count: int, size: tuple[int, int] = (32, 24)) -> bytes:
    frames = [Image.new("RGB", size, (i * 40 % 256, 90, 200 - i)) for i in range(count)]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
@pytest.mark.parametrize("count", [1, 2, 9])
def test_frame_count_is_read_from_the_container(fmt: str, count: int) -> None:
    from shared.frames import frame_count
    from shared.sniff import sniff_format

    data = _animation(fmt, count)
    with Image.open(io.BytesIO(data)) as img:
        assert frame_count(data, sniff_format(data) or "") == img.n_frames == count


@pytest.mark.parametrize(("canvas", "count"), [((2000, 2000), 300), ((6000, 6000), 2000)])
def test_a_multi_frame_bomb_is_refused_before_any_decode(canvas: tuple[int, int], count: int) -> None:
    data = imagegen.gif_bomb(*canvas, count)
    assert len(data) < 50_000  # a few KB that would cost canvas x frames to draw
    with pytest.raises(ImageTooLarge, match=f"{count} frames"):
        images.inspect(data, LIMIT)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_frames_count_against_the_pixel_limit_in_every_animated_format(fmt: str) -> None:
    data = _animation(fmt, 5, (100, 100))
    assert images.inspect(data, 50_000).frames == 5
    with pytest.raises(ImageTooLarge):
        images.inspect(data, 49_999)


def test_an_animation_within_the_limit_decodes_its_first_frame_only() -> None:
    data = imagegen.gif_bomb(200, 100, 150)  # 3 MP in all: allowed, one 200x100 frame decoded
    decoded = images.load(data, LIMIT)
    assert (decoded.width, decoded.height) == (200, 100)
    assert decoded.tensor[:, 0, 0].tolist() == [255, 255, 255]
    assert decoded.tensor[:, 0, 1].sum() == 0


def _oriented_pil(data: bytes) -> torch.Tensor:
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as img:
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    return torch.from_numpy(__import__("numpy").asarray(rgb).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_matches_pil(fmt: str, orientation: int) -> None:
    img = Image.open(io.BytesIO(imagegen.photo(60, 40, fmt="PNG"))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(img, fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {}))
    _assert_turned_as_pil_turns(data, fmt, orientation)


def _assert_turned_as_pil_turns(data: bytes, fmt: str, orientation: int) -> None:
    encoded = images.inspect(data, LIMIT)
    assert encoded.orientation == orientation
    decoded = images.decode(encoded)
    expected = _oriented_pil(data)
    assert (encoded.height, encoded.width) == tuple(decoded.tensor.shape[-2:]) == tuple(expected.shape[-2:])
    # JPEG: two IDCTs (libjpeg-turbo in torchvision and in PIL) may differ by a level or two.
    tolerance = 2.0 if fmt == "JPEG" else 0.0
    assert (decoded.tensor.float() - expected.float()).abs().mean().item() <= tolerance


@pytest.mark.parametrize("size", [(2500, 1), (1, 2500), (2500, 2)])
@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_a_one_row_photo_turned_by_its_exif_is_resized_as_a_plain_copy_would_be(
    size: tuple[int, int], orientation: int
) -> None:
    """A 2500x1 photo turned a quarter by its EXIF: the turned tensor's strides were once (2500, 1,
    2500) on the CPU, which torch's uint8 antialiased resize read out of bounds (random patches, or
    the worker killed by SIGSEGV; found by a review helper on the tree before 5f60a68). Now the
    decode's layout is resized exactly as a contiguous copy of the same pixels is."""
    from workers.backends.fuyu_preprocess import resize_to_fit

    img = Image.new("RGB", size)
    img.putdata([(n % 251, (7 * n) % 253, (13 * n) % 255) for n in range(size[0] * size[1])])
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = images.decode(images.inspect(_encode(img, "PNG", exif=exif.tobytes()), LIMIT))
    expected = _oriented_pil(_encode(img, "PNG", exif=exif.tobytes())).contiguous()
    assert torch.equal(decoded.tensor, expected)
    for _ in range(3):  # an out-of-bounds read shows as patches that differ from run to run
        assert torch.equal(resize_to_fit(decoded.tensor, 480), resize_to_fit(expected, 480))


def _pixels(width: int, height: int) -> bytes:
    return bytes(
        (x * 7 + y * 13 + c * 50) % 251 + 1 for y in range(height) for x in range(width) for c in range(3)
    )


@pytest.mark.parametrize(
    ("interlaced", "rows_kept", "said"),
    [
        (False, 24, "its pixel data stops after row 24 of 48"),
        (False, 47, "its pixel data stops after row 47 of 48"),
        (False, 1, "its pixel data stops after row 1 of 48"),
        # Adam7 passes of 64x48 RGB hold 150, 150, 294, 588, 1164, 2328 and 4632 bytes.
        (True, 6, "its pixel data holds 150 of the 9306 bytes its 64x48 header needs"),
        (True, 66, "its pixel data holds 4674 of the 9306 bytes"),
    ],
)
def test_a_png_whose_pixel_stream_ends_early_is_refused_not_decoded_part_black(
    interlaced: bool, rows_kept: int, said: str
) -> None:
    """Every chunk valid, the zlib stream ended cleanly at a row's end with rows still to come: PIL
    decoded it and left them black, so the model would have answered about part of a photo."""
    data = imagegen.png_rows(_pixels(64, 48), 64, 48, interlaced=interlaced, rows_kept=rows_kept)
    with pytest.raises(ImageDecodeError, match="png data is truncated") as refused:
        images.load(data, LIMIT)
    assert said in refused.value.message


@pytest.mark.parametrize("interlace_byte", [2, 255])
def test_a_png_read_as_interlaced_is_counted_as_interlaced(interlace_byte: int) -> None:
    """Review, helper-88: PIL reads any interlace byte but 0 as Adam7; counted against the smaller
    plain size, a stream cut late in the seventh pass passed with rows black."""
    # 8x400: Adam7's 750 rows hold 10,350 bytes, the plain 400 rows 10,000; all but 3 of the last
    # pass's rows (25 bytes each) is more than the plain size, less than the interlaced one.
    data = imagegen.png_rows(_pixels(8, 400), 8, 400, True, 750 - 3, interlace_byte)
    with pytest.raises(ImageDecodeError, match="png data is truncated: its pixel data holds 10275 of"):
        images.load(data, LIMIT)


@pytest.mark.parametrize("frame", [(64, 32, 0, 0), (64, 32, 0, 16), (32, 48, 32, 0)])
def test_an_animated_png_whose_default_frame_is_part_of_the_image_is_refused(
    frame: tuple[int, int, int, int],
) -> None:
    """Review, helper-88: PIL decoded only the default frame's rectangle of the pixel data and left
    the rest black, above or beside it, where the last-row gate never looked."""
    data = imagegen.apng_default_frame(_pixels(64, 48), 64, 48, frame)
    with pytest.raises(ImageDecodeError, match="png data is not a whole image: its first frame is"):
        images.load(data, LIMIT)
    whole = images.load(imagegen.apng_default_frame(_pixels(64, 48), 64, 48, (64, 48, 0, 0)), LIMIT)
    assert whole.tensor.permute(1, 2, 0).contiguous().flatten().tolist() == list(_pixels(64, 48))


def _layouts() -> dict[str, tuple[bytes, str]]:
    """PNGs laid out as PIL reads them and a parse of our own would not (review, helper-89): each
    decoded by PIL with most of the picture black, and what the refusal must say."""
    import struct
    import zlib

    def ihdr(height: int) -> tuple[bytes, bytes]:
        return b"IHDR", struct.pack(">IIBBBBB", 64, height, 8, 2, 0, 0, 0)

    def fctl(seq: int, width: int, height: int) -> tuple[bytes, bytes]:
        return b"fcTL", struct.pack(">IIIIIHHBB", seq, width, height, 0, 0, 1, 10, 0, 0)

    rgb = _pixels(64, 48)
    rows = [b"\x00" + rgb[y * 192 : (y + 1) * 192] for y in range(48)]
    whole, half = zlib.compress(b"".join(rows)), zlib.compress(b"".join(rows[:24]))
    actl, end = (b"acTL", struct.pack(">II", 1, 0)), (b"IEND", b"")
    short_frame = "not a whole image: its first frame is 64x10 at (0, 0); the image is 64x48"
    half_rows = "truncated: its pixel data stops after row 24 of 48"
    return {
        "the last of two frame controls is the one PIL draws": (
            imagegen.png_file(ihdr(48), actl, fctl(0, 64, 48), fctl(1, 64, 10), (b"IDAT", whole), end),
            short_frame,
        ),
        "a frame's data before the image data is what PIL decodes": (
            imagegen.png_file(
                ihdr(48), actl, fctl(0, 64, 48), (b"fdAT", struct.pack(">I", 1) + half), (b"IDAT", whole), end
            ),
            half_rows,
        ),
        "a chunk before the header is skipped by PIL": (
            imagegen.png_file((b"tEXt", b"k\x00v"), ihdr(48), (b"IDAT", half), end),
            half_rows,
        ),
        "the last of two headers is the one PIL keeps": (
            imagegen.png_file(ihdr(24), ihdr(48), (b"IDAT", half), end),
            half_rows,
        ),
        "and with a short frame control after them": (
            imagegen.png_file(ihdr(10), ihdr(48), fctl(0, 64, 10), (b"IDAT", whole), end),
            short_frame,
        ),
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_what_pil_decodes_is_what_is_checked_however_the_chunks_lie(layout: str) -> None:
    data, said = _layouts()[layout]
    with pytest.raises(ImageDecodeError) as refused:
        images.load(data, LIMIT)
    assert said in refused.value.message


def test_the_bits_per_pixel_of_every_raw_mode_pil_reads_a_png_in_are_known() -> None:
    """The count sizes a stream by PIL's raw mode: one it did not know would go unchecked."""
    from PIL import PngImagePlugin

    from workers import png_data

    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
    for (depth, colour), (_mode, rawmode) in PngImagePlugin._MODES.items():
        assert png_data.BITS[rawmode] == depth * channels[colour], rawmode


@pytest.mark.parametrize(("width", "height"), [(64, 48), (1, 1), (3, 2), (5, 9), (13, 1)])
@pytest.mark.parametrize("interlaced", [False, True])
def test_a_whole_png_decodes_to_its_pixels_interlaced_or_not(
    width: int, height: int, interlaced: bool
) -> None:
    """The count of bytes an image needs is right for every Adam7 pass shape, empty passes included:
    a whole file is never refused as short."""
    rgb = _pixels(width, height)
    decoded = images.load(imagegen.png_rows(rgb, width, height, interlaced=interlaced), LIMIT)
    assert decoded.tensor.permute(1, 2, 0).contiguous().flatten().tolist() == list(rgb)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"])
def test_a_whole_png_with_a_black_last_row_decodes(mode: str) -> None:
    """A black last row is what PIL leaves unwritten, so it sends the file to the count: in every
    mode and bit depth the count must find the whole image there."""
    img = Image.new("RGB", (37, 20), (200, 100, 50))
    img.paste((0, 0, 0), (0, 19, 37, 20))
    if mode == "I;16":
        img = Image.new("I;16", (37, 20), 40000)
        img.paste(0, (0, 19, 37, 20))
    else:
        img = img.convert(mode)
    decoded = images.load(_encode(img, "PNG"), LIMIT)
    assert decoded.tensor.shape == (3, 20, 37)
    assert decoded.tensor[:, -1].max() == 0


def _xmp(orientation: int, element: bool) -> str:
    held = (
        f"<tiff:Orientation>{orientation}</tiff:Orientation>"
        if element
        else f'<rdf:Description tiff:Orientation="{orientation}"/>'
    )
    return (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"'
        f' xmlns:tiff="http://ns.adobe.com/tiff/1.0/">{held}</rdf:RDF></x:xmpmeta>'
    )


def _with_xmp(img: Image.Image, fmt: str, packet: str) -> bytes:
    if fmt == "PNG":
        from PIL import PngImagePlugin

        info = PngImagePlugin.PngInfo()
        info.add_itxt("XML:com.adobe.xmp", packet)
        return _encode(img, fmt, pnginfo=info)
    return _encode(img, fmt, xmp=packet.encode(), **({"lossless": True} if fmt == "WEBP" else {}))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("element", [False, True])
def test_an_orientation_given_in_xmp_alone_is_applied_as_pil_applies_it(
    fmt: str, orientation: int, element: bool
) -> None:
    """Before, a photo whose orientation was in its XMP packet only (no EXIF tag) was shown as stored,
    where PIL's exif_transpose (and so the processor's reference) turns it."""
    img = Image.open(io.BytesIO(imagegen.photo(60, 40, fmt="PNG"))).convert("RGB")
    _assert_turned_as_pil_turns(_with_xmp(img, fmt, _xmp(orientation, element)), fmt, orientation)


def test_an_exif_orientation_wins_over_xmp_as_in_pil() -> None:
    img = Image.open(io.BytesIO(imagegen.photo(60, 40, fmt="PNG"))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 1
    data = _encode(img, "JPEG", exif=exif.tobytes(), xmp=_xmp(6, False).encode())
    assert images.inspect(data, LIMIT).orientation == 1
    assert tuple(_oriented_pil(data).shape[-2:]) == (40, 60)


def test_imagemagicks_raw_exif_profile_in_a_png_is_read() -> None:
    """ImageMagick writes a PNG's EXIF as hex in a text chunk, which PIL reads (and turns by)."""
    from PIL import PngImagePlugin

    img = Image.open(io.BytesIO(imagegen.photo(60, 40, fmt="PNG"))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    raw = exif.tobytes()
    info = PngImagePlugin.PngInfo()
    info.add_text("Raw profile type exif", f"\nexif\n{len(raw):8d}\n{raw.hex()}\n")
    data = _encode(img, "PNG", pnginfo=info)
    encoded = images.inspect(data, LIMIT)
    assert encoded.orientation == 6
    assert torch.equal(images.decode(encoded).tensor, _oriented_pil(data))
