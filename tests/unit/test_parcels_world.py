"""The parcel world (scripts/parcels.py) keeps to its description: checks outside the repository draw
their own photos from it, and the parcels model was trained on ours. Also: the training batches feed
the model what FuyuProcessor would, and the JSON answer it was taught is one the grammar allows."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from scripts import parcels
from scripts import parcels_batches as pb
from workers.models import parcels_path

SEEDS = range(80)


@pytest.fixture(scope="module")
def drawn() -> list[tuple[bytes, parcels.Parcel]]:
    return [parcels.make(seed) for seed in SEEDS]


def test_sizes_formats_and_floor(drawn: list[tuple[bytes, parcels.Parcel]]) -> None:
    formats = set()
    for data, truth in drawn:
        image = Image.open(io.BytesIO(data))
        assert image.size == (truth.width, truth.height)
        assert image.mode == "RGB"
        assert 160 <= truth.width <= 1024
        assert 120 <= truth.height <= 768
        assert 0.5 <= truth.width / truth.height <= 2.5
        formats.add(image.format)
        pixels = np.asarray(image.convert("RGB"))
        corner = pixels[: max(1, truth.box[1]), :]  # floor above the parcel (may be a thin strip)
        if image.format == "PNG" and corner.size:
            assert corner.min() >= 150
    assert formats == {"JPEG", "PNG"}
    widths = [t.width for _d, t in drawn]
    assert min(widths) < 300
    assert max(widths) > 900


def test_parcel_label_and_damage_keep_to_the_description(drawn: list[tuple[bytes, parcels.Parcel]]) -> None:
    for _data, t in drawn:
        x0, y0, x1, y1 = t.box
        assert x0 >= 0
        assert y0 >= 0
        assert x1 <= t.width
        assert y1 <= t.height
        assert 0.15 <= (x1 - x0) * (y1 - y0) / (t.width * t.height) <= 0.50
        lx0, ly0, lx1, ly1 = t.label
        assert x0 <= lx0 < lx1 <= x1
        assert y0 <= ly0 < ly1 <= y1
        gx0, gy0, gx1, gy1 = t.glyph
        assert lx0 <= gx0
        assert gx1 <= lx1
        assert ly0 <= gy0
        assert gy1 <= ly1
        assert gy1 - gy0 >= max(24, 0.12 * min(t.width, t.height))
        if t.damaged:
            short = min(x1 - x0, y1 - y0)
            assert len(t.line) >= 4  # three segments or more
            assert t.line_width >= 0.02 * short
            xs, ys = [p[0] for p in t.line], [p[1] for p in t.line]
            assert all(x0 <= x < x1 and y0 <= y < y1 for x, y in t.line)
            assert max(xs) - min(xs) >= 0.5 * (x1 - x0) or max(ys) - min(ys) >= 0.5 * (y1 - y0)
    assert {t.colour for _d, t in drawn} == set(parcels.COLOURS)
    assert 0.35 < sum(t.damaged for _d, t in drawn) / len(drawn) < 0.65
    assert {t.digit for _d, t in drawn} == set(range(10))


def test_the_parcel_is_its_colour_and_the_label_holds_dark_ink(
    drawn: list[tuple[bytes, parcels.Parcel]],
) -> None:
    for data, t in drawn:
        if t.fmt != "PNG":  # lossless: the pixels are what was drawn
            continue
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
        x0, y0, x1, y1 = t.box
        inside = pixels[y0:y1, x0:x1].reshape(-1, 3)
        values, counts = np.unique(inside, axis=0, return_counts=True)
        fill = values[counts.argmax()]  # the parcel's own colour: the label and the line cover less
        assert np.abs(fill - np.array(parcels.COLOURS[t.colour])).max() <= 20
        gx0, gy0, gx1, gy1 = t.glyph
        ink = pixels[gy0:gy1, gx0:gx1]
        assert ink.max() >= 230  # the white label shows between the strokes
        assert (ink.max(axis=2) <= 60).sum() >= 0.05 * ink.shape[0] * ink.shape[1]
    assert isinstance(ImageFont.load_default(size=30), ImageFont.FreeTypeFont)


def test_questions_and_answers() -> None:
    _data, t = parcels.make(5)
    for kind, wordings in parcels.QUESTIONS.items():
        for wording in wordings:
            assert parcels.kind_of(wording) == kind
        assert parcels.is_right(kind, f" {t.answer(kind).upper()} ", t)
    assert {parcels.question(s, "colour") for s in range(40)} == set(parcels.QUESTIONS["colour"])
    assert t.answer("colour") in parcels.COLOURS
    assert t.answer("damage") in ("yes", "no")


def test_a_seed_draws_the_same_photo() -> None:
    assert parcels.make(11) == parcels.make(11)
    assert parcels.make(11)[0] != parcels.make(12)[0]
    assert parcels.sample_size(random.Random(1)) == parcels.sample_size(random.Random(1))


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(parcels_path(), local_files_only=True)


def test_training_rows_equal_the_processors_inputs(processor: Any) -> None:
    """What scripts/train_parcels.py feeds the model is what FuyuProcessor (and the worker) serve,
    near-black padding of sizes that are not multiples of 30 included."""
    batcher = pb.Batcher(processor.tokenizer)
    for seed in (21, 22, 23):
        data, truth = parcels.make(seed)
        prompt = parcels.question(seed, "digit")
        image = Image.open(io.BytesIO(data)).convert("RGB")
        ref = processor(text=[prompt], images=[image], return_tensors="pt", return_legacy_image_output=False)
        for source in (data, *([image] if truth.fmt == "PNG" else [])):
            ours = batcher.build([(source, truth, "digit", prompt)])
            assert torch.equal(ref["input_ids"][0], ours.input_ids[0, : int(ours.answer_pos[0]) + 1])
            assert torch.equal(ref["pixel_values"], ours.pixel_values)


def test_the_taught_json_answer_is_one_the_grammar_allows(processor: Any) -> None:
    from transformers import AutoConfig

    from shared.response_format import JsonSchemaFormat
    from workers.grammar import Grammars

    tokenizer = processor.tokenizer
    vocab_size = AutoConfig.from_pretrained(parcels_path(), local_files_only=True).text_config.vocab_size
    grammars = Grammars(tokenizer, vocab_size, int(tokenizer.eos_token_id), keep=2)

    constraint, _ = grammars.constraint(JsonSchemaFormat(type="json_schema", schema=parcels.SCHEMA))
    vocab = tokenizer.get_vocab()
    for seed in (1, 2, 3, 4):
        _data, t = parcels.make(seed)
        constraint.reset()
        for piece in pb.answer_pieces("json", t):
            constraint.accept(vocab[piece])
        assert constraint.complete
        text = tokenizer.decode([vocab[p] for p in pb.answer_pieces("json", t)])
        assert json.loads(text) == t.as_json()


def test_mrc_model_parcels_loads_the_committed_model_and_sees_colours() -> None:
    """MRC_MODEL=parcels: the package's folder, through the same loader as Fuyu-8B; it sees colour."""
    from shared.settings import Settings
    from workers import images
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import FuyuBackend

    backend = FuyuBackend(Settings(model="parcels", quantization="fp32", device="cpu"))
    backend.load()
    assert backend.model_id == "parcels-fuyu-v1"
    truths, batch = [], []
    for seed in range(700_000, 700_008):
        data, truth = parcels.make(seed, (320, 240))
        truths.append(truth)
        tensor = images.load(data, 10**7).tensor
        batch.append(GenerationInput(image=tensor, prompt=parcels.question(seed, "colour"), max_new_tokens=2))
    answers = [out.text for out in backend.generate(batch)]
    assert answers == [t.colour for t in truths]
