"""JPEG decoding on the CPU: the worker's path (TurboJPEG through simplejpeg, strict: workers/jpeg_decode.py,
called as the worker calls it, header check included) against torchvision's decode_jpeg (the worker's
decoder before) and PIL (the naive pipeline's), same bytes, same run, one thread. ms per image, median.
The last rows are what strictness costs: a photo with bytes before its end marker (libjpeg warns, the
worker decodes it again without stopping) and a cut one (refused, where the others decoded it grey).

    .venv/bin/python tests/bench/bench_jpeg_decode.py [--passes 7] [--quick]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set
from PIL import Image  # noqa: E402 - after sys.path is set
from torchvision.io import ImageReadMode, decode_jpeg  # noqa: E402 - after sys.path is set

from shared.errors import ImageDecodeError  # noqa: E402 - after sys.path is set
from tests.bench.bench_png_check import median_ms  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set
from workers import images  # noqa: E402 - after sys.path is set

SIZES = ((4000, 3000, "photo 12 MP"), (1920, 1080, "photo full HD"), (640, 480, "photo 640x480"))
QUICK_SIZES = ((800, 600, "photo (quick: 800x600)"), (320, 240, "photo (quick: 320x240)"))


def torchvision_decode(data: bytes) -> torch.Tensor:
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def pil_decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def refused(data: bytes) -> None:
    try:
        images.load(data, 10**9)
    except ImageDecodeError:
        return
    raise AssertionError("a cut JPEG was decoded")


def variants(width: int, height: int) -> dict[str, bytes]:
    photo = imagegen.camera_photo(width, height, seed=5)
    progressive = io.BytesIO()
    Image.open(io.BytesIO(photo)).save(progressive, format="JPEG", quality=90, progressive=True)
    return {
        "baseline": photo,
        "progressive": progressive.getvalue(),
        "padded before its end marker (warns)": photo[:-2] + b"\0\0\0" + photo[-2:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cpu threads: 1 of {os.cpu_count()}; median of {args.passes}")
    print(
        "| image | JPEG | worker (TurboJPEG, strict) | torchvision decode_jpeg | PIL | worker ÷ torchvision |"
    )
    print("|---|---|---|---|---|---|")
    for width, height, kind in QUICK_SIZES if args.quick else SIZES:
        for name, data in variants(width, height).items():
            ours = median_ms(lambda data=data: images.load(data, 10**9), args.passes)
            theirs = median_ms(lambda data=data: torchvision_decode(data), args.passes)
            pil = median_ms(lambda data=data: pil_decode(data), args.passes)
            print(
                f"| {kind} | {name} | {ours:.1f} ms | {theirs:.1f} ms | {pil:.1f} ms | {ours / theirs:.2f}x |"
            )
        photo = variants(width, height)["baseline"]
        cut = photo[: len(photo) // 2] + b"\xff\xd9"
        ours = median_ms(lambda cut=cut: refused(cut), args.passes)
        theirs = median_ms(lambda cut=cut: torchvision_decode(cut), args.passes)
        pil = median_ms(lambda cut=cut: pil_decode(cut), args.passes)
        print(
            f"| {kind} | cut in half, end marker added | refused in {ours:.1f} ms | "
            f"grey rows in {theirs:.1f} ms | grey rows in {pil:.1f} ms | |"
        )


if __name__ == "__main__":
    main()
