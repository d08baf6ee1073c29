"""Drive the engine over real model inputs for oracle tests: each job submitted at its arrival step."""

from __future__ import annotations

import random
from typing import Any

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


def tiny_backend(home: str, device: str = "cpu", quantization: str = "fp32") -> FuyuBackend:
    """The tiny Fuyu the tests use, loaded."""
    from shared.settings import Settings

    backend = FuyuBackend(Settings(model="tiny", home=home, quantization=quantization, device=device))
    backend.load()
    return backend


def random_items(rng: random.Random, prompts: list[str]) -> list[GenerationInput]:
    """Two to six jobs of random pictures (30-400 pixels a side), prompts and new tokens (1-24)."""
    return [
        GenerationInput(
            torch.randint(0, 256, (3, rng.randint(30, 400), rng.randint(30, 400)), dtype=torch.uint8),
            rng.choice(prompts), rng.randint(1, 24),
        )
        for _ in range(rng.randint(2, 6))
    ]  # fmt: skip


def three_rows_one_gone(backend: FuyuBackend, runner: Any) -> tuple[Any, list[int]]:
    """Three rows of three picture sizes prefilled into the runner's batch, the middle one (r1) gone
    again (a hole in the cache); the batch and the two rows' first tokens."""
    batch = runner.new_batch()
    tokens: list[int] = []
    for index, (height, width) in enumerate([(48, 64), (30, 30), (90, 120)]):
        image = torch.full((3, height, width), 40 + 50 * index, dtype=torch.uint8)
        inputs = backend.prepare([GenerationInput(image, "Refund?", 4)]).inputs
        first, cache, length = runner.prefill([inputs])
        batch.add([f"r{index}"], cache, length)
        tokens += first
    batch.drop({"r1"})
    del tokens[1]
    return batch, tokens


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
    backend: FuyuBackend,
    items: list[GenerationInput],
    arrivals: list[int],
    max_rows: int = 8,
    decode: str | None = None,
    capture: bool = False,
) -> list[list[int]]:
    """Each job's generated tokens, the jobs joining the running batch at their arrival steps (`decode`:
    MRC_ENGINE_DECODE's choice unless said; `capture`: its fixed-shape steps as CUDA graphs)."""
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows, 0)
    runner = backend.step_model(max_rows, decode=decode)
    if capture:
        assert backend.capture(runner) > 0, "no step was captured"
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
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
