"""Fuyu's image preprocessing and input building, on the worker's device, for a whole batch.

Equal to FuyuProcessor (tests/unit/test_preprocess_parity.py checks it) without its waste: the
processor pads every image to 1080x1920 and normalises the whole canvas in float32 before cropping
back to the patch grid; here only the patch grid is built, in uint8, and normalised once, straight
into the model's dtype.

Steps per image: resize to fit 1080x1920 (shrink only, aspect kept; torchvision's bilinear with
antialias on uint8, the processor's own operation, so it is bit-exact on the CPU), pad right/bottom
to a multiple of 30 with the processor's fill value, cut into 30x30 patches in (row, col, channel)
order, normalise with mean = std = 0.5. kornia is not used for the resize: its antialias is a
Gaussian blur, ~10x slower on the CPU and not what the processor does (see docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torchvision.transforms.v2.functional as tvF

from workers.backends.fuyu_geometry import PATCH, fit_size

# The processor pads uint8 images with fill_value=1.0 before rescaling: padding pixels are 1, not 0.
PAD_VALUE = 1
MEAN = STD = 127.5  # 0.5 after rescaling by 1/255, fused as the processor fuses it


def resize_to_fit(image: torch.Tensor, max_side: int = 0) -> torch.Tensor:
    """uint8 CHW -> uint8 CHW no larger than 1080x1920 (and max_side)."""
    height, width = image.shape[-2:]
    new_h, new_w = fit_size(height, width, max_side)
    if (new_h, new_w) == (height, width):
        return image
    resized: torch.Tensor = tvF.resize(
        image, [new_h, new_w], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True
    )
    return resized


def patchify(image: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 CHW (already resized) -> [rows*cols, 30*30*3] normalised patches in `dtype`, written into
    `out` when given (a slice of the batch's pixel_values, so no concatenation is needed)."""
    channels, height, width = image.shape
    rows, cols = math.ceil(height / PATCH), math.ceil(width / PATCH)
    if (rows * PATCH, cols * PATCH) != (height, width):
        # The canvas keeps the bytes pixel by pixel, as decoded photos are (workers/images.py).
        canvas = image.new_full((rows * PATCH, cols * PATCH, channels), PAD_VALUE).permute(2, 0, 1)
        canvas[:, :height, :width] = image
        image = canvas
    # [C, rows, 30, cols, 30] -> [rows, cols, 30, 30, C]: the processor's unfold/permute order. The
    # reorder runs on the bytes, then one contiguous pass widens them (a third faster than reordering
    # into float32). With the bytes pixel by pixel (a decoded photo's layout) it moves runs of 30
    # pixels; plane by plane it gathers byte by byte (a 1440x1080 photo: ~3 ms against ~11 ms).
    patches = image.view(channels, rows, PATCH, cols, PATCH).permute(1, 3, 2, 4, 0).contiguous()
    flat = patches.view(rows * cols, PATCH * PATCH * channels)
    # Widened straight into the model's dtype and normalised there, in place: no float32 copy of the
    # photo (4 bytes a value, every page of it new memory: profiled, the page faults of that copy
    # were most of a worker's decode-thread time). The values are the processor's to the bit: a byte
    # minus 127.5 is exact in bfloat16 and float16, and each op computes in float32 and rounds once,
    # as float32 then a cast does (tests/unit/test_preprocess_parity.py, every byte value).
    target = torch.empty(flat.shape, dtype=dtype, device=flat.device) if out is None else out
    target.copy_(flat)
    return target.sub_(MEAN).div_(STD)


@dataclass(frozen=True)
class Pixels:
    """One image's model input, made once per photo (workers/decoded_images.py keeps it with the
    decoded photo for its next question): its normalised patches and their grid."""

    values: torch.Tensor  # [rows*cols, 30*30*3]
    rows: int
    cols: int


def pixels_of(image: torch.Tensor, dtype: torch.dtype, max_side: int = 0) -> Pixels:
    """uint8 CHW (any size) -> its patches as `build_inputs` would make them."""
    resized = resize_to_fit(image, max_side)
    rows, cols = math.ceil(resized.shape[1] / PATCH), math.ceil(resized.shape[2] / PATCH)
    return Pixels(patchify(resized, dtype), rows, cols)


@dataclass(frozen=True)
class TokenIds:
    """The few token ids input building needs, read once from the tokenizer."""

    image: int  # |SPEAKER|
    newline: int  # |NEWLINE|
    bos: int  # <s>
    pad: int


def image_placeholder(rows: int, cols: int, ids: TokenIds) -> list[int]:
    row = [ids.image] * cols + [ids.newline]
    return row * rows + [ids.bos]


def _grid(known: Pixels | None, resized: torch.Tensor | None) -> tuple[int, int]:
    if known is not None:
        return known.rows, known.cols
    assert resized is not None
    return math.ceil(resized.shape[1] / PATCH), math.ceil(resized.shape[2] / PATCH)


def build_inputs(
    images: Sequence[torch.Tensor],
    prompt_ids: Sequence[Sequence[int]],
    ids: TokenIds,
    dtype: torch.dtype,
    device: torch.device | str,
    max_side: int = 0,
    made: Sequence[Pixels | None] = (),
) -> dict[str, Any]:
    """Model inputs for a batch: left-padded input_ids and attention_mask, and concatenated pixel_values.

    `prompt_ids` are the tokenized "<prompt><0x04>" of each job (what the processor tokenizes after <s>).
    `made`: an image's patches made already (`pixels_of`, kept with its photo), used as they are.
    """
    rows_of_ids: list[list[int]] = []
    made = list(made) or [None] * len(images)
    resized = [
        None if known is not None else resize_to_fit(image.to(device, non_blocking=True), max_side)
        for image, known in zip(images, made, strict=True)
    ]
    grids = [_grid(known, image) for known, image in zip(made, resized, strict=True)]
    only = made[0] if len(made) == 1 else None
    if only is not None and only.values.dtype == dtype and only.values.device == torch.device(device):
        pixel_values = only.values  # one row (the engine's) of a photo made once: no copy, nothing writes it
    else:
        pixel_values = torch.empty(
            (sum(r * c for r, c in grids), PATCH * PATCH * 3), dtype=dtype, device=device
        )
        start = 0
        for image, known, (rows, cols) in zip(resized, made, grids, strict=True):
            part = pixel_values[start : start + rows * cols]
            if known is not None:
                part.copy_(known.values)
            else:
                assert image is not None
                patchify(image, dtype, out=part)
            start += rows * cols
    for (rows, cols), prompt in zip(grids, prompt_ids, strict=True):
        rows_of_ids.append(image_placeholder(rows, cols, ids) + list(prompt))
    longest = max(len(r) for r in rows_of_ids)
    input_ids = torch.full((len(rows_of_ids), longest), ids.pad, dtype=torch.long)
    attention = torch.zeros((len(rows_of_ids), longest), dtype=torch.long)
    for i, row in enumerate(rows_of_ids):
        input_ids[i, longest - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention[i, longest - len(row) :] = 1
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "pixel_values": pixel_values,
    }
