"""Training batches for the parcels model, built the way the worker builds its inputs.

The worker decodes with workers/images.py and cuts patches with
workers/backends/fuyu_preprocess.py; so do these batches, so the model learns exactly what it is
served (FuyuProcessor's near-black padding included: preprocess.patchify pads as the processor does,
and scripts/train_parcels.py checks a few batches against the processor itself). The processor is
not used per sample: it pads every image to 1080 x 1920 and costs ~64 ms an image here.

Each row: image placeholder, <s>, the question's ids, <0x04>, the answer's ids, end-of-text. Rows are
right-padded: with causal attention no real position sees a pad, so no attention mask is needed and
the fast causal attention path runs.

Besides the answer, every batch carries per-patch targets (what covers each 30 x 30 patch: floor,
parcel of which colour, label; whether the damage line crosses it; which digit's ink it holds). The
training script puts small heads on a middle layer for them: dense supervision that teaches the
patch embedding what to see long before the one answer token per row could. The heads are dropped
when the model is saved.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from scripts import parcels
from workers import images
from workers.backends import fuyu_preprocess as preprocess
from workers.backends.fuyu_geometry import PATCH

# Vocabulary pieces of the parcels model beyond the base (bytes, characters): the questions' words
# with "▁" (as the tokenizer's normalizer writes a space), and the answers without it, so a choice
# grammar (which allows no leading space) and a free answer take the same single token.
ANSWERS = (*parcels.COLOURS, "yes", "no")
JSON_KEYS = {"colour": '{"colour":', "damaged": ',▁"damaged":', "digit": ',▁"digit":'}


def pieces() -> list[tuple[str, float]]:
    words: set[str] = set()
    for text in [*(q for qs in parcels.QUESTIONS.values() for q in qs), parcels.JSON_PROMPT]:
        words.update(text.rstrip("?.").split())
    out = [("▁" + w, -4.0) for w in sorted(words)]
    out += [(a, -4.0) for a in ANSWERS]
    out += [(k, -3.0) for k in JSON_KEYS.values()]
    out += [(f'▁"{c}"', -3.0) for c in parcels.COLOURS]
    out += [("▁true", -3.0), ("▁false", -3.0), *((f"▁{d}", -3.0) for d in range(10))]
    return out


def answer_pieces(kind: str, parcel: parcels.Parcel) -> list[str]:
    """The answer's tokens (end-of-text not included). `json` answers SCHEMA the way xgrammar writes
    it with no free whitespace: `{"colour": "red", "damaged": true, "digit": 7}`."""
    if kind == "json":
        damaged = "▁true" if parcel.damaged else "▁false"
        return [
            JSON_KEYS["colour"],
            f'▁"{parcel.colour}"',
            JSON_KEYS["damaged"],
            damaged,
            JSON_KEYS["digit"],
            f"▁{parcel.digit}",
            "}",
        ]
    return [parcel.answer(kind)]


REGIONS = 8  # floor, the six parcel colours, label
NO_DIGIT = 10


@dataclass
class Batch:
    input_ids: torch.Tensor  # [rows, T]
    pixel_values: torch.Tensor  # [rows * patches, 2700]
    answer_rows: torch.Tensor  # [n] row of each predicted answer token
    answer_pos: torch.Tensor  # [n] the position whose logits predict it
    answer_ids: torch.Tensor  # [n]
    first: torch.Tensor  # [n] bool: the answer's first token (what accuracy is read from)
    kinds: list[str]  # per row
    patch_pos: torch.Tensor  # [patches] positions of the image tokens (the same in every row)
    region: torch.Tensor  # [rows, patches] class, -100 for padding patches
    line: torch.Tensor  # [rows, patches] 1 crossed, 0 clear, -1 ignored
    digit: torch.Tensor  # [rows, patches] 0-9 the ink's digit, 10 none, -100 ignored
    line_so_far: torch.Tensor  # [rows, patches] as line, for this patch and every one before it
    digit_so_far: torch.Tensor  # [rows, patches] the digit once its ink has gone by, 10 before
    tokens: int


class Batcher:
    """Batches of one image size (no padding inside the image part), questions drawn per row."""

    def __init__(self, tokenizer: Any, max_pixels: int = 1 << 26) -> None:
        self.tokenizer = tokenizer
        self.max_pixels = max_pixels
        vocab = tokenizer.get_vocab()
        self.vocab = vocab
        self.ids = preprocess.TokenIds(
            image=vocab["|SPEAKER|"], newline=vocab["|NEWLINE|"], bos=vocab["<s>"], pad=0
        )
        self.answer_id = vocab["<0x04>"]
        self.eos = int(tokenizer.eos_token_id)
        self.prompts = {
            text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
            for text in [*(q for qs in parcels.QUESTIONS.values() for q in qs), parcels.JSON_PROMPT]
        }

    def prompt_for(self, rng: random.Random, kind: str) -> str:
        return parcels.JSON_PROMPT if kind == "json" else rng.choice(parcels.QUESTIONS[kind])

    def row_ids(self, prompt: str, answer: list[str], rows: int, cols: int) -> tuple[list[int], int]:
        """The row's ids and the position of its first answer token."""
        head = preprocess.image_placeholder(rows, cols, self.ids) + self.prompts[prompt] + [self.answer_id]
        return head + [self.vocab[p] for p in answer] + [self.eos], len(head)

    def build(self, samples: list[tuple[bytes | Image.Image, parcels.Parcel, str, str]]) -> Batch:
        """samples: (encoded image or a PNG's pixels, truth, kind, prompt), all of one size."""
        width, height = samples[0][1].width, samples[0][1].height
        rows, cols = math.ceil(height / PATCH), math.ceil(width / PATCH)
        per = rows * cols
        pixel_values = torch.empty((len(samples) * per, PATCH * PATCH * 3), dtype=torch.float32)
        id_rows, a_rows, a_pos, a_ids, first = [], [], [], [], []
        targets: list[list[np.ndarray]] = [[], [], [], [], []]
        for i, (data, truth, kind, prompt) in enumerate(samples):
            assert (truth.width, truth.height) == (width, height)
            if isinstance(data, Image.Image):
                tensor = torch.from_numpy(np.array(data)).permute(2, 0, 1).contiguous()
            else:
                tensor = images.load(data, self.max_pixels).tensor
            preprocess.patchify(tensor, torch.float32, out=pixel_values[i * per : (i + 1) * per])
            ids, start = self.row_ids(prompt, answer_pieces(kind, truth), rows, cols)
            id_rows.append(ids)
            for j in range(start, len(ids)):
                a_rows.append(i)
                a_pos.append(j - 1)
                a_ids.append(ids[j])
                first.append(j == start)
            for into, target in zip(targets, patch_targets(truth, rows, cols), strict=True):
                into.append(target)
        longest = max(len(r) for r in id_rows)
        input_ids = torch.zeros((len(id_rows), longest), dtype=torch.long)
        for i, ids in enumerate(id_rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
        patch_pos = torch.tensor([r * (cols + 1) + c for r in range(rows) for c in range(cols)])
        return Batch(
            input_ids=input_ids,
            pixel_values=pixel_values,
            answer_rows=torch.tensor(a_rows),
            answer_pos=torch.tensor(a_pos),
            answer_ids=torch.tensor(a_ids),
            first=torch.tensor(first),
            kinds=[s[2] for s in samples],
            patch_pos=patch_pos,
            region=torch.from_numpy(np.stack(targets[0])),
            line=torch.from_numpy(np.stack(targets[1])),
            digit=torch.from_numpy(np.stack(targets[2])),
            line_so_far=torch.from_numpy(np.stack(targets[3])),
            digit_so_far=torch.from_numpy(np.stack(targets[4])),
            tokens=int(input_ids.numel()),
        )


def _overlap(lo: np.ndarray, hi: np.ndarray, a: int, b: int) -> np.ndarray:
    return np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0, None).astype(np.float32)


def _box_area(truth: parcels.Parcel, box: tuple[int, int, int, int], rows: int, cols: int) -> np.ndarray:
    """[rows, cols] pixels of each patch inside `box`."""
    starts_y, starts_x = np.arange(rows) * PATCH, np.arange(cols) * PATCH
    oy = _overlap(starts_y, starts_y + PATCH, box[1], box[3])
    ox = _overlap(starts_x, starts_x + PATCH, box[0], box[2])
    return np.outer(oy, ox)


def patch_targets(truth: parcels.Parcel, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """Per patch (row-major, flattened): region class, line crossing, digit ink."""
    full = (0, 0, truth.width, truth.height)
    valid = _box_area(truth, full, rows, cols)
    label = _box_area(truth, truth.label, rows, cols)
    parcel = _box_area(truth, truth.box, rows, cols) - label
    floor = valid - parcel - label
    colour = list(parcels.COLOURS).index(truth.colour) + 1
    region = np.stack([floor, parcel, label]).argmax(0)
    region = np.select([region == 0, region == 1], [0, colour], REGIONS - 1).astype(np.int64)
    region[valid == 0] = -100
    line = np.zeros((rows, cols), dtype=np.float32)
    if truth.damaged:
        mask = Image.new("L", (cols * PATCH, rows * PATCH), 0)
        canvas = ImageDraw.Draw(mask)
        canvas.line(list(truth.line), fill=255, width=truth.line_width, joint="curve")
        if not truth.line_over_label:
            x0, y0, x1, y1 = truth.label
            canvas.rectangle([x0, y0, x1 - 1, y1 - 1], fill=0)
        cover = np.asarray(mask, dtype=np.float32).reshape(rows, PATCH, cols, PATCH).mean((1, 3)) / 255
        line = np.where(cover > 0.02, 1.0, np.where(cover > 0, -1.0, 0.0)).astype(np.float32)
    ink = _box_area(truth, truth.glyph, rows, cols)
    share = ink / max(1.0, float(ink.sum()))
    digit = np.where(share >= 0.2, truth.digit, np.where(share > 0, -100, NO_DIGIT)).astype(np.int64)
    digit[valid == 0] = -100
    return region.reshape(-1), line.reshape(-1), digit.reshape(-1), *so_far(line.reshape(-1), share, truth)


def so_far(line: np.ndarray, share: np.ndarray, truth: parcels.Parcel) -> tuple[np.ndarray, np.ndarray]:
    """What the photo has shown up to each patch, in the model's (raster) order: the damage line yet
    (1, 0, -1 unsure), the digit once 90 % of its ink has gone by (10 before any, -100 in between).
    A causal model's patch sees only the patches before it, so the last one can know the answers: a
    target at every patch, where the answer alone gives one per photo."""
    crossed = np.maximum.accumulate(line == 1)
    unsure = np.maximum.accumulate(line < 0) & ~crossed
    line_so_far = np.where(crossed, 1.0, np.where(unsure, -1.0, 0.0)).astype(np.float32)
    seen = np.cumsum(share.reshape(-1))
    digit_so_far = np.where(seen >= 0.9, truth.digit, np.where(seen <= 0, NO_DIGIT, -100)).astype(np.int64)
    return line_so_far, digit_so_far
