"""Fuyu's image arithmetic without torch: the size an image is resized to, its patch grid, and how
many sequence positions it takes. One place, used by preprocessing, the backends and batching."""

from __future__ import annotations

import math

PATCH = 30
MAX_H, MAX_W = 1080, 1920


def fit_size(height: int, width: int, max_side: int = 0) -> tuple[int, int]:
    """Fuyu's resize-to-fit 1080x1920 (shrink only, aspect kept, int() truncation), plus a side cap."""
    target_h, target_w = MAX_H, MAX_W
    if max_side:
        target_h, target_w = min(target_h, max_side), min(target_w, max_side)
    if height <= target_h and width <= target_w:
        return height, width
    scale = min(target_h / height, target_w / width)
    return max(1, int(height * scale)), max(1, int(width * scale))


def grid(height: int, width: int, max_side: int = 0) -> tuple[int, int]:
    """Patch rows and columns of an image after resize-to-fit."""
    h, w = fit_size(height, width, max_side)
    return math.ceil(h / PATCH), math.ceil(w / PATCH)


def max_image_tokens(max_side: int = 0) -> int:
    """The most positions any image takes: the resize-to-fit box filled (a side cap shrinks it)."""
    height, width = (min(MAX_H, max_side), min(MAX_W, max_side)) if max_side else (MAX_H, MAX_W)
    return math.ceil(height / PATCH) * (math.ceil(width / PATCH) + 1)


def image_token_count(height: int, width: int, max_side: int = 0) -> int:
    """Sequence positions an image takes: one per patch plus one newline per patch row."""
    rows, cols = grid(height, width, max_side)
    return rows * (cols + 1)
