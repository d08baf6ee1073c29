"""Image format from the leading bytes, never from a file name."""

from __future__ import annotations

# What the worker decodes; anything else fails as unsupported_image_format (and mrc-api refuses it).
SUPPORTED_FORMATS = frozenset({"jpg", "png", "webp", "gif", "bmp"})

_SIGNATURES: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "jpg"),
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"BM", 0, "bmp"),
    (b"II*\x00", 0, "tiff"),
    (b"MM\x00*", 0, "tiff"),
)


def sniff_format(data: bytes) -> str | None:
    """The image format ("jpg", "png", "webp", ...) the bytes really are, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, offset, fmt in _SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            return fmt
    return None
