"""What the PNG pixel-data count costs (workers/png_data.py): a PNG decode where the check does not run
(its last row is not all zero), the same picture with a black last row (the count runs: a second
inflate of the pixel stream), and the count alone, side by side in one run. ms per image, median.

    .venv/bin/python tests/bench/bench_png_check.py [--passes 5] [--quick]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402 - after sys.path is set
from PIL import Image  # noqa: E402 - after sys.path is set

from tests.support import imagegen  # noqa: E402 - after sys.path is set
from workers import images, png_data  # noqa: E402 - after sys.path is set

SIZES = ((4000, 3000, "photo 12 MP"), (1920, 1080, "screenshot full HD"), (640, 480, "small 640x480"))
QUICK_SIZES = ((800, 600, "photo (quick: 800x600)"), (640, 360, "screenshot (quick: 640x360)"))


def pngs(width: int, height: int, photo: bool) -> tuple[bytes, bytes]:
    """The picture as a PNG, and the same with its last row black."""
    if photo:
        jpeg = imagegen.camera_photo(width, height, seed=3)
        pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")).copy()
    else:
        pixels = np.asarray(Image.open(io.BytesIO(imagegen.screenshot(width, height, seed=3)))).copy()
    pixels[-1] = np.maximum(pixels[-1], 1)  # the plain one's last row is never all zero
    plain = _encode(pixels)
    pixels[-1] = 0
    return plain, _encode(pixels)


def _encode(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def count(data: bytes) -> str | None:
    """The count alone, as the worker runs it: on what PIL's header read says it will decode."""
    with Image.open(io.BytesIO(data)) as img:
        return png_data.shortfall(data, img.size, img.tile, bool(img.info.get("interlace")))


def median_ms(fn: Callable[[], object], passes: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(passes):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(
        "| image | PNG bytes | decode, check skipped | black last row: decode + count | ratio | count alone |"
    )
    print("|---|---|---|---|---|---|")
    for width, height, kind in QUICK_SIZES if args.quick else SIZES:
        plain, black = pngs(width, height, photo=kind.startswith("photo") or kind.startswith("small"))
        skipped = median_ms(lambda data=plain: images.load(data, 10**9), args.passes)
        checked = median_ms(lambda data=black: images.load(data, 10**9), args.passes)
        alone = median_ms(lambda data=black: count(data), args.passes)
        assert count(black) is None  # whole files: the count finds nothing missing
        print(
            f"| {kind} | {len(black):,} | {skipped:.1f} ms | {checked:.1f} ms | "
            f"{checked / skipped:.2f}x | {alone:.1f} ms |"
        )


if __name__ == "__main__":
    main()
