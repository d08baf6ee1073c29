"""Drive the engine over real model inputs for oracle tests: each job submitted at its arrival step."""

from __future__ import annotations

import torch

from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence

SIZES = [(48, 64), (90, 120), (200, 150), (240, 320)]  # (height, width) of the oracle tests' images
PROMPTS = ["Refund?", "Is the parcel damaged at all, or only the box?", "What is written on the label here?"]


def photo(size: int, photo: int, prompt: int, new: int) -> GenerationInput:
    """Photo `photo` of a size, asked question `prompt`: the questions of one photo share its prefix."""
    height, width = SIZES[size]
    fill = 30 + 40 * size + 11 * photo
    image = torch.full((3, height, width), fill, dtype=torch.uint8)
    image[:, : height // 3] = 255 - fill
    return GenerationInput(image, PROMPTS[prompt], new)


def alone(backend: FuyuBackend, item: GenerationInput) -> list[int]:
    """The oracle's reference: the job through generate() by itself, cut at end-of-text."""
    prepared = backend.prepare([item])
    with torch.inference_mode():
        out = backend.model.generate(
            **prepared.inputs, max_new_tokens=item.max_new_tokens, do_sample=False,
            pad_token_id=backend.token_ids.pad, eos_token_id=backend.eos_id,
        )  # fmt: skip
    row = out[0, prepared.inputs["input_ids"].shape[1] :].tolist()
    return row[: row.index(backend.eos_id)] if backend.eos_id in row else row


def engine_tokens(
    backend: FuyuBackend, items: list[GenerationInput], arrivals: list[int], max_rows: int = 8
) -> list[list[int]]:
    """Each job's generated tokens, the jobs joining the running batch at their arrival steps."""
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows, 0)
    engine = Engine(backend.step_model(max_rows), limits, lambda row: done.__setitem__(row.row_id, row))
    pending = sorted(range(len(items)), key=lambda i: arrivals[i])
    while pending or not engine.idle:
        while pending and arrivals[pending[0]] <= engine.steps:
            index = pending.pop(0)
            inputs, positions = backend.row_inputs(items[index])
            engine.submit(
                Sequence(str(index), inputs, positions, items[index].max_new_tokens, backend.eos_id)
            )
        engine.step()
    return [done[str(i)].tokens for i in range(len(items))]


def drive(engine: Engine, arrivals: list[tuple[Sequence, int]], limit: int = 500) -> None:
    """Submit each row at its arrival step; step until every row has finished (at most `limit` steps)."""
    pending = sorted(arrivals, key=lambda pair: pair[1])
    while pending or not engine.idle:
        while pending and pending[0][1] <= engine.steps:
            engine.submit(pending.pop(0)[0])
        engine.step()
        assert engine.steps < limit, (
            f"no end after {limit} steps: waiting {[r.row_id for r in engine.waiting]}"
        )
