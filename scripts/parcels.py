"""The parcel world: synthetic parcel photos, the questions asked about them, and their right answers.

One module for everyone who draws these images: the training script of the `parcels` model
(scripts/train_parcels.py), the demo, the accuracy test and the benchmarks. What it draws is the world
issue 32 fixes, and checks outside the repository draw their own images from the same description:

- image: width x height from 160 x 120 to 1024 x 768, aspect 0.5-2.5, JPEG (quality 60-95) or PNG,
  RGB; a light floor (grey, beige or off-white, every channel >= 150) with mild noise or a gentle
  gradient;
- parcel: one axis-aligned rectangle, 15-50 % of the image's area, fully inside it, in one of six
  colours (each channel +-20);
- damage (half the parcels): a dark jagged line of 3 or more segments, at least 2 % of the parcel's
  shorter side wide, darker than the parcel, across at least half of it;
- label: a white rectangle inside the parcel with one black digit drawn with Pillow's own
  `ImageFont.load_default(size=...)`, the glyph at least 12 % of the image's shorter side and 24 px tall;
- questions, in these wordings, answered with one word.

Everything is drawn from a `random.Random` (and a numpy generator seeded from it): a seed gives the
same image on every machine with the same Pillow.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (200, 30, 30),
    "green": (30, 150, 50),
    "blue": (30, 60, 200),
    "yellow": (230, 200, 30),
    "brown": (120, 75, 35),
    "black": (25, 25, 25),
}
QUESTIONS: dict[str, tuple[str, ...]] = {
    "colour": ("What colour is the parcel?", "What color is the box?", "Which colour is the package?"),
    "damage": ("Is the parcel damaged?", "Is the box damaged?"),
    "digit": ("What number is on the label?", "Which digit is on the box?"),
}
KINDS = tuple(QUESTIONS)
# One job that answers all three: the prompt the model was taught for it, and the schema it fills.
JSON_PROMPT = "Describe the parcel as JSON."
SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "colour": {"enum": list(COLOURS)},
        "damaged": {"type": "boolean"},
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "damaged", "digit"],
    "additionalProperties": False,
}

MIN_W, MIN_H, MAX_W, MAX_H = 160, 120, 1024, 768
MIN_ASPECT, MAX_ASPECT = 0.5, 2.5
FLOORS = {"grey": (200, 200, 200), "beige": (222, 205, 175), "off-white": (240, 238, 230)}


@dataclass(frozen=True)
class Parcel:
    """The truth about one drawn image, and where things are (for per-patch training targets)."""

    width: int
    height: int
    colour: str
    damaged: bool
    digit: int
    fmt: str  # "JPEG" or "PNG"
    box: tuple[int, int, int, int]  # the parcel, x0, y0, x1, y1 (exclusive)
    label: tuple[int, int, int, int]  # the white label
    glyph: tuple[int, int, int, int]  # the digit's ink
    line: tuple[tuple[int, int], ...]  # the damage line's points (empty when undamaged)
    line_width: int
    line_over_label: bool  # the line was drawn after the label (a tear across it too)

    def answer(self, kind: str) -> str:
        if kind == "colour":
            return self.colour
        if kind == "damage":
            return "yes" if self.damaged else "no"
        if kind == "digit":
            return str(self.digit)
        raise ValueError(f"unknown question kind {kind!r}")

    def as_json(self) -> dict[str, object]:
        """What a job with SCHEMA should answer."""
        return {"colour": self.colour, "damaged": self.damaged, "digit": self.digit}


def kind_of(question: str) -> str:
    """The question kind of one of the wordings."""
    for kind, wordings in QUESTIONS.items():
        if question in wordings:
            return kind
    raise ValueError(f"not one of the parcel questions: {question!r}")


def is_right(kind: str, text: str | None, parcel: Parcel) -> bool:
    """A free answer is right when it is the one word (surrounding spaces and case aside)."""
    return (text or "").strip().lower() == parcel.answer(kind)


def sample_size(rng: random.Random, max_w: int = MAX_W) -> tuple[int, int]:
    """A width and height of the world: aspect uniform in 0.5-2.5, then the width uniform in what
    that aspect allows (`max_w` lowers the widest drawn, for cheap training batches)."""
    while True:
        aspect = rng.uniform(MIN_ASPECT, MAX_ASPECT)
        low = max(MIN_W, math.ceil(MIN_H * aspect))
        high = min(max_w, MAX_W, math.floor(MAX_H * aspect))
        if low > high:
            continue
        width = rng.randint(low, high)
        height = min(MAX_H, max(MIN_H, round(width / aspect)))
        if MIN_ASPECT <= width / height <= MAX_ASPECT:
            return width, height


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


@cache
def _font_for(height: int) -> tuple[int, int]:
    """The smallest load_default size whose every digit's ink is at least `height` px tall, and the
    tallest ink at that size."""
    size = max(8, int(height / 0.75))
    while True:
        heights = [_ink(size, str(d))[3] - _ink(size, str(d))[1] for d in range(10)]
        if min(heights) >= height:
            return size, max(heights)
        size += 1


@cache
def _ink(size: int, text: str) -> tuple[int, int, int, int]:
    """The digit's ink box when drawn at (0, 0) with anchor 'la' (Pillow's default)."""
    font = _font(size)
    canvas = Image.new("L", (size * 2, size * 2), 0)
    ImageDraw.Draw(canvas).text((0, 0), text, fill=255, font=font)
    box = canvas.getbbox()
    assert box is not None
    return box


def _jitter(rng: random.Random, rgb: tuple[int, int, int], spread: int) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, c + rng.randint(-spread, spread))) for c in rgb)
    return r, g, b


def _floor(rng: random.Random, nprng: np.random.Generator, width: int, height: int) -> np.ndarray:
    base = np.array(_jitter(rng, FLOORS[rng.choice(list(FLOORS))], 12), dtype=np.float32)
    if rng.random() < 0.5:  # a gentle gradient along a random direction
        angle = rng.uniform(0, 2 * math.pi)
        scale = rng.uniform(-25, 25) / max(width, height)
        ramp_x = np.arange(width, dtype=np.float32) * (math.cos(angle) * scale)
        ramp_y = np.arange(height, dtype=np.float32) * (math.sin(angle) * scale)
        pixels = base + (ramp_y[:, None] + ramp_x[None, :])[..., None]
    else:  # mild noise
        noise = nprng.standard_normal((height, width, 3), dtype=np.float32)
        pixels = base + noise * np.float32(rng.uniform(2, 6))
    return np.clip(pixels, 150, 255, out=pixels)


def _parcel_box(
    rng: random.Random, width: int, height: int, label_w: int, label_h: int
) -> tuple[int, int, int, int] | None:
    area = rng.uniform(0.15, 0.50) * width * height
    ratio = math.exp(rng.uniform(math.log(0.4), math.log(2.5)))
    pw = min(width - 2, round(math.sqrt(area * ratio)))
    ph = min(height - 2, round(area / pw))
    if not 0.15 <= pw * ph / (width * height) <= 0.50:
        return None
    if pw < label_w + 8 or ph < label_h + 8:
        return None
    x0 = rng.randint(1, width - pw - 1)
    y0 = rng.randint(1, height - ph - 1)
    return x0, y0, x0 + pw, y0 + ph


def _damage_line(rng: random.Random, box: tuple[int, int, int, int]) -> tuple[list[tuple[int, int]], int]:
    """A zig-zag of 3-6 segments across 50-100 % of the parcel, along its longer or shorter side."""
    x0, y0, x1, y1 = box
    short = min(x1 - x0, y1 - y0)
    width = max(2, math.ceil(0.02 * short), round(rng.uniform(0.02, 0.07) * short))
    margin = width // 2 + 1
    horizontal = rng.random() < 0.5
    along = (x0 + margin, x1 - margin) if horizontal else (y0 + margin, y1 - margin)
    across = (y0 + margin, y1 - margin) if horizontal else (x0 + margin, x1 - margin)
    length = along[1] - along[0]
    side = (x1 - x0) if horizontal else (y1 - y0)
    span = max(rng.uniform(0.55, 1.0) * length, min(length, 0.5 * side + 2))
    start = rng.uniform(along[0], along[1] - span)
    segments = rng.randint(3, 6)
    points = []
    for i in range(segments + 1):
        a = start + span * i / segments
        b = rng.uniform(*across)
        points.append((round(a), round(b)) if horizontal else (round(b), round(a)))
    return points, width


def _line_colour(rng: random.Random, parcel_rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Darker than the parcel in every channel: a fraction of its colour, or a dark grey below it."""
    k = rng.uniform(0.0, 0.45)
    grey = rng.randint(0, 40)
    r, g, b = (max(0, min(round(c * k), grey, c - 12)) for c in parcel_rgb)
    return r, g, b


def draw(rng: random.Random, size: tuple[int, int] | None = None) -> tuple[Image.Image, Parcel]:
    """One parcel photo (not yet encoded) and its truth."""
    width, height = size or sample_size(rng)
    nprng = np.random.default_rng(rng.getrandbits(64))
    short = min(width, height)
    glyph_h = round(max(24, 0.12 * short) * rng.uniform(1.0, 1.5))
    font_size, ink_h = _font_for(glyph_h)
    digit = rng.randrange(10)
    ink = _ink(font_size, str(digit))
    ink_w = ink[2] - ink[0]
    pad_x, pad_y = round(ink_h * rng.uniform(0.2, 0.5)), round(ink_h * rng.uniform(0.15, 0.4))
    label_w, label_h = ink_w + 2 * pad_x, ink_h + 2 * pad_y
    box = None
    while box is None:
        box = _parcel_box(rng, width, height, label_w, label_h)
    colour = rng.choice(list(COLOURS))
    parcel_rgb = _jitter(rng, COLOURS[colour], 20)
    image = Image.fromarray(_floor(rng, nprng, width, height).astype(np.uint8), "RGB")
    canvas = ImageDraw.Draw(image)
    canvas.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=parcel_rgb)
    damaged = rng.random() < 0.5
    line: list[tuple[int, int]] = []
    line_width = 0
    if damaged:
        line, line_width = _damage_line(rng, box)
    lx = rng.randint(box[0] + 4, box[2] - 4 - label_w)
    ly = rng.randint(box[1] + 4, box[3] - 4 - label_h)
    label_rgb = _jitter(rng, (250, 250, 250), 5)
    ink_rgb = _jitter(rng, (15, 15, 15), 15)
    gx, gy = lx + pad_x - ink[0], ly + pad_y - ink[1]  # the text origin that puts the ink there
    over_label = rng.random() < 0.3  # a tear across the label too, now and then
    if damaged and not over_label:
        canvas.line(line, fill=_line_colour(rng, parcel_rgb), width=line_width, joint="curve")
    canvas.rectangle([lx, ly, lx + label_w - 1, ly + label_h - 1], fill=label_rgb)
    canvas.text((gx, gy), str(digit), fill=ink_rgb, font=_font(font_size))
    if damaged and over_label:
        canvas.line(line, fill=_line_colour(rng, parcel_rgb), width=line_width, joint="curve")
    glyph = (gx + ink[0], gy + ink[1], gx + ink[2], gy + ink[3])
    fmt = "JPEG" if rng.random() < 0.7 else "PNG"
    label = (lx, ly, lx + label_w, ly + label_h)
    truth = Parcel(
        width, height, colour, damaged, digit, fmt, box, label, glyph, tuple(line), line_width, over_label
    )
    return image, truth


def encode(image: Image.Image, fmt: str, rng: random.Random) -> bytes:
    out = io.BytesIO()
    if fmt == "JPEG":
        image.save(out, format="JPEG", quality=rng.randint(60, 95))
    else:
        image.save(out, format="PNG")
    return out.getvalue()


def make(seed: int, size: tuple[int, int] | None = None) -> tuple[bytes, Parcel]:
    """The encoded photo and truth for one seed: the same bytes on every call."""
    rng = random.Random(seed)
    image, truth = draw(rng, size)
    return encode(image, truth.fmt, rng), truth


def make_pixels(seed: int, size: tuple[int, int] | None = None) -> tuple[Image.Image | bytes, Parcel]:
    """`make` for training loops: a PNG's pixels as the image itself (PNG is lossless, so decoding the
    file would give exactly these), a JPEG's encoded bytes (its loss is part of the world)."""
    rng = random.Random(seed)
    image, truth = draw(rng, size)
    return (encode(image, truth.fmt, rng) if truth.fmt == "JPEG" else image), truth


def question(seed: int, kind: str) -> str:
    """One of the kind's wordings, chosen by the seed (every wording gets asked across seeds)."""
    wordings = QUESTIONS[kind]
    return wordings[random.Random(seed * 7919 + KINDS.index(kind)).randrange(len(wordings))]
