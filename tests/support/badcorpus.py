"""The bad-input corpus, generated (never stored as blobs): images and prompts that must each end in
one clear outcome. `python -m tests.support.badcorpus DIR` writes it to DIR for manual runs."""

from __future__ import annotations

import io
import sys
import zlib
from pathlib import Path

from PIL import Image

from tests.support import imagegen


def _png(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def _corrupt_png_chunk() -> bytes:
    data = bytearray(_png(Image.new("RGB", (64, 64), (10, 200, 30))))
    idat = data.index(b"IDAT")
    data[idat + 8 : idat + 16] = b"\x00" * 8  # compressed image data mangled, CRC now wrong too
    return bytes(data)


def _animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (48, 32), c) for c in ((250, 0, 0), (0, 0, 250), (0, 250, 0))]
    out = io.BytesIO()
    frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return out.getvalue()


def _cmyk_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("CMYK", (80, 60), (0, 120, 200, 10)).save(out, format="JPEG")
    return out.getvalue()


def _sixteen_bit_png() -> bytes:
    import numpy as np

    return _png(Image.fromarray(np.linspace(0, 65535, 64 * 48, dtype=np.uint16).reshape(48, 64)))


# name -> (bytes, expected error code or None for success)
def images() -> dict[str, tuple[bytes, str | None]]:
    return {
        "truncated.jpg": (imagegen.truncated_jpeg(), "image_decode_error"),
        # Given its end marker back: libjpeg decoded the missing rows grey and only warned.
        "truncated-then-ended.jpg": (imagegen.truncated_jpeg() + b"\xff\xd9", "image_decode_error"),
        "corrupt-chunk.png": (_corrupt_png_chunk(), "image_decode_error"),
        "empty.jpg": (b"", "unsupported_image_format"),
        "text-named.jpg": (b"Dear support, my parcel is broken.\n", "unsupported_image_format"),
        "bomb-60000x60000.png": (imagegen.png_header_only(60000, 60000), "image_too_large"),
        "zlib-not-image.webp": (zlib.compress(b"x" * 1000), "unsupported_image_format"),
        "one-pixel.png": (_png(Image.new("RGB", (1, 1), (255, 255, 255))), None),
        "strip-1x5000.png": (_png(Image.new("RGB", (1, 5000), (90, 90, 90))), None),
        "strip-5000x1.png": (_png(Image.new("RGB", (5000, 1), (90, 90, 90))), None),
        "sixteen-bit.png": (_sixteen_bit_png(), None),
        "cmyk.jpg": (_cmyk_jpeg(), None),
        "animated.gif": (_animated("GIF"), None),
        "animated.webp": (_animated("WEBP"), None),
        "animated.png": (_animated("PNG"), None),
        # 300 1x1 frames on a 2000x2000 canvas: 2.3 KB that cost 1.2 GB when every frame was drawn.
        "gif-bomb-300-frames.gif": (imagegen.gif_bomb(2000, 2000, 300), "image_too_large"),
        "gif-bomb-2000-frames.gif": (imagegen.gif_bomb(6000, 6000, 2000), "image_too_large"),
    }


# name -> (prompt, True when the producer must refuse it, i.e. exit 2 / UsageError)
def prompts() -> dict[str, tuple[str, bool]]:
    return {
        "100k-chars": ("refund? " * 12_500, True),
        "nul-byte": ("can I\x00 get a refund", True),
        "lone-surrogate": ("refund \ud800 please", True),
        "only-whitespace": (" \t\n\u3000 ", True),
        "rtl": ("هل يمكنني استرداد المبلغ؟ \u202eevil\u202c שלום", False),
        "pipes-equals-backslashes": ("|=\\" * 300 + " a|b=c\\d |", False),
        "newlines-and-cr": ("line one\nline two\r\nline three\r", False),
        "emoji-and-cjk": ("📦💥 这个包裹坏了 😡", False),
    }


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, _code) in images().items():
        (folder / name).write_bytes(data)
    for name, (text, _refused) in prompts().items():
        (folder / f"prompt-{name}.txt").write_bytes(text.encode("utf-8", "surrogatepass"))


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/bad"))
