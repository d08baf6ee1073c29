"""Sample images made on the fly (never stored as blobs): for the demo and the tests."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw


def photo(width: int, height: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A synthetic 'parcel photo': gradient background, a box, some text."""
    img = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(img)
    for y in range(0, height, max(1, height // 32)):
        shade = (40 + (y * 180) // max(1, height) + seed * 13) % 256
        draw.rectangle([0, y, width, y + height // 32 + 1], fill=(shade, 120, 255 - shade))
    draw.rectangle(
        [width // 4, height // 4, 3 * width // 4, 3 * height // 4], fill=(160, 110, 60), outline=(0, 0, 0)
    )
    draw.text((width // 4 + 4, height // 4 + 4), f"PARCEL {seed}", fill=(255, 255, 255))
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()
