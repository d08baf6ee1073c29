"""The parts of the parcels model's training that are not the loop: the batches of each step (a size
curriculum, questions drawn per row), the training-only per-patch heads and their losses, the patch
embedding's starting point, and held-out evaluation. scripts/train_parcels.py runs them.
"""

from __future__ import annotations

import argparse
import math
import random
from typing import Any

import torch
from torch import nn

from scripts import parcels
from scripts import parcels_batches as pb

# Seeds: training images draw theirs from [10^9, 2 x 10^9); every seed below 10^9 is free for held-out
# sets, tests, demos and benchmarks (the held-out set here starts at 900,000,000).
TRAIN_SEEDS = (1_000_000_000, 2_000_000_000)
HELD_OUT_SEED = 900_000_000
# Questions per training row: colour is learned in minutes; damage and the digit need the rows.
KIND_WEIGHTS = {"colour": 0.1, "damage": 0.45, "digit": 0.3, "json": 0.15}


def _binary(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BCE over the targets that are not -1; positives weigh 5x (a line crosses few patches)."""
    keep = target >= 0
    if not keep.any():
        return logits.sum() * 0
    weight = torch.tensor(5.0)
    return nn.functional.binary_cross_entropy_with_logits(logits[keep], target[keep], pos_weight=weight)


def _digits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CE over the patches with a digit, plus a fifth of it over those with none."""
    loss = logits.sum() * 0
    ink = (target >= 0) & (target < pb.NO_DIGIT)
    blank = target == pb.NO_DIGIT
    if ink.any():
        loss = loss + nn.functional.cross_entropy(logits[ink], target[ink])
    if blank.any():
        loss = loss + 0.2 * nn.functional.cross_entropy(logits[blank], target[blank])
    return loss


class PatchHeads(nn.Module):
    """Per-patch classifiers, training only: what each patch shows, on a middle layer's states; and
    what the photo has shown up to each patch, on the last layer's (scripts/parcels_batches.py)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.region = nn.Linear(hidden, pb.REGIONS)
        self.line = nn.Linear(hidden, 1)
        self.digit = nn.Linear(hidden, pb.NO_DIGIT + 1)
        self.line_so_far = nn.Linear(hidden, 1)
        self.digit_so_far = nn.Linear(hidden, pb.NO_DIGIT + 1)
        self.parts: tuple[float, ...] = ()

    def loss(self, middle: torch.Tensor, last: torch.Tensor, batch: pb.Batch) -> torch.Tensor:
        h = middle[:, batch.patch_pos].float()  # [rows, patches, hidden]
        top = last[:, batch.patch_pos].float()
        parts = (
            nn.functional.cross_entropy(self.region(h).flatten(0, 1), batch.region.flatten()),
            _binary(self.line(h).squeeze(-1), batch.line),
            _digits(self.digit(h), batch.digit),
            _binary(self.line_so_far(top).squeeze(-1), batch.line_so_far),
            _digits(self.digit_so_far(top), batch.digit_so_far),
        )
        self.parts = tuple(float(p.detach()) for p in parts)
        return sum(parts, start=h.sum() * 0)


def dct_embedding(model: Any, batch: pb.Batch) -> None:
    """Start the patch embedding (a linear map of the 30 x 30 x 3 pixels) from what a photo is made
    of instead of noise: the mean colour of each 10 x 10 block (27 dimensions), and the 2-D cosine
    basis of the patch's brightness, low frequencies first, without the constant one (the rest). A
    thin dark line or a glyph's stroke is energy in those cosine terms, which the relu2 MLP after it
    can square and sum; from random projections it first has to find them. One scale for the whole
    map, so its outputs spread as the default initialisation's do."""
    import numpy as np

    embed = model.model.vision_embed_tokens
    hidden = embed.out_features
    size = 30
    rows = []
    for by in range(3):
        for bx in range(3):
            for channel in range(3):
                w = np.zeros((size, size, 3))
                w[by * 10 : by * 10 + 10, bx * 10 : bx * 10 + 10, channel] = 1 / 100
                rows.append(w.reshape(-1))
    grid = np.arange(size)
    frequencies = sorted(((u, v) for u in range(size) for v in range(size) if (u, v) != (0, 0)),
                         key=lambda uv: (uv[0] + uv[1], uv[0]))  # fmt: skip
    for u, v in frequencies[: hidden - len(rows)]:
        basis = np.outer(np.cos(np.pi * (grid + 0.5) * u / size), np.cos(np.pi * (grid + 0.5) * v / size))
        basis /= np.linalg.norm(basis)
        rows.append(np.repeat(basis[:, :, None] / 3, 3, axis=2).reshape(-1))
    weight = torch.tensor(np.stack(rows), dtype=torch.float32)
    with torch.no_grad():
        scale = 0.5 / float((batch.pixel_values @ weight.T).std())
        embed.weight.copy_(weight * scale)
        embed.bias.zero_()


class Batches(torch.utils.data.Dataset[pb.Batch]):
    """Step k's batch, drawn from its own seed: the same batches whichever process draws them."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer = tokenizer
        self.args = args
        self.batcher: pb.Batcher | None = None

    def __len__(self) -> int:
        return int(self.args.steps)

    def widest(self, step: int, rng: random.Random) -> int:
        """The curriculum of sizes: small photos first (few patches: what to look at is easy to find,
        and each costs little), the cap growing to the world's widest by 60 % of the steps; then a
        third of the batches from the whole world, the rest no wider than 320-640 px."""
        progress = step / max(1, self.args.steps)
        if progress < self.args.small_until:
            return 320
        if progress < 0.6:
            grown = (progress - self.args.small_until) / (0.6 - self.args.small_until)
            return rng.randint(320, 320 + round(grown * (parcels.MAX_W - 320)))
        return parcels.MAX_W if rng.random() < 0.34 else rng.choice((320, 480, 640))

    def __getitem__(self, step: int) -> pb.Batch:
        if self.batcher is None:
            torch.set_num_threads(1)
            self.batcher = pb.Batcher(self.tokenizer)
        rng = random.Random(self.args.seed * 1_000_003 + step)
        width, height = parcels.sample_size(rng, self.widest(step, rng))
        positions = math.ceil(height / 30) * (math.ceil(width / 30) + 1) + 24
        rows = max(2, min(self.args.max_rows, self.args.token_budget // positions))
        samples = []
        for _ in range(rows):
            image, truth = parcels.make_pixels(rng.randrange(*TRAIN_SEEDS), (width, height))
            kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
            samples.append((image, truth, kind, self.batcher.prompt_for(rng, kind)))
        return self.batcher.build(samples)


def answer_logits(model: Any, batch: pb.Batch, hidden_states: bool = False) -> tuple[torch.Tensor, Any]:
    out = model.model(
        input_ids=batch.input_ids, pixel_values=batch.pixel_values, output_hidden_states=hidden_states
    )
    chosen = out.last_hidden_state[batch.answer_rows, batch.answer_pos]
    return model.lm_head(chosen).float(), out


@torch.no_grad()
def evaluate(model: Any, batcher: pb.Batcher, count: int, bf16: bool = False) -> dict[str, float]:
    """Held-out accuracy of the first answer token per kind (one token answers colour, damage and the
    digit), and of the JSON answer's three values with the answer so far given (teacher-forced)."""
    model.eval()
    right: dict[str, int] = {}
    seen: dict[str, int] = {}
    for i in range(count):
        data, truth = parcels.make(HELD_OUT_SEED + i)
        samples = [(data, truth, kind, parcels.question(i, kind)) for kind in parcels.KINDS]
        samples.append((data, truth, "json", parcels.JSON_PROMPT))
        batch = batcher.build(samples)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            predicted = answer_logits(model, batch)[0].argmax(-1)
        hits = predicted == batch.answer_ids
        for row, kind in enumerate(batch.kinds):
            mine = batch.answer_rows == row
            if kind == "json":  # the value tokens: pieces 1, 3 and 5 of the seven
                values = hits[mine][[1, 3, 5]].tolist()
                for name, ok in zip(("json.colour", "json.damaged", "json.digit"), values, strict=True):
                    right[name] = right.get(name, 0) + int(ok)
            else:
                ok = int(hits[mine & batch.first].item())
                right[kind] = right.get(kind, 0) + ok
                bucket = "small" if truth.width * truth.height <= 400 * 300 else "large"
                right[f"{kind}@{bucket}"] = right.get(f"{kind}@{bucket}", 0) + ok
                seen[f"{kind}@{bucket}"] = seen.get(f"{kind}@{bucket}", 0) + 1
    model.train()
    return {k: round(v / seen.get(k, count), 3) for k, v in sorted(right.items())}
