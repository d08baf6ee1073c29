"""The engine's oracle on CUDA: a row beside others, joining at any step, against the same row alone.
Skipped where no GPU is present. bf16 and NF4 kernels may pick different reduction orders for
different batch shapes, so agreement is measured and reported, and held to a floor, not assumed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
PROMPTS = ["Refund?", "Is the parcel damaged at all, or only the box?", "What is written on the label?"]


def _tokens(backend: FuyuBackend, items: list[GenerationInput], arrivals: list[int]) -> list[list[int]]:
    done: dict[str, Sequence] = {}
    engine = Engine(
        backend.step_model(), scheduler.Limits(8, 1 << 20, 0), lambda r: done.__setitem__(r.row_id, r)
    )
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


@pytest.mark.parametrize(("quantization", "floor"), [("fp32", 1.0), ("bf16", 0.9), ("nf4", 0.9)])
def test_rows_agree_with_the_same_row_alone_on_cuda(quantization: str, floor: float) -> None:
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization=quantization, device="cuda"))
    backend.load()
    rng = random.Random(3)
    agree = total = 0
    trials = 20
    for _ in range(trials):
        items = [
            GenerationInput(
                torch.randint(0, 256, (3, rng.randint(30, 400), rng.randint(30, 400)), dtype=torch.uint8),
                rng.choice(PROMPTS), rng.randint(1, 24),
            )
            for _ in range(rng.randint(2, 6))
        ]  # fmt: skip
        together = _tokens(backend, items, [rng.randint(0, 8) for _ in items])
        for item, row in zip(items, together, strict=True):
            total += 1
            agree += row == _tokens(backend, [item], [0])[0]
    rate = agree / total
    print(f"{quantization}: {agree}/{total} rows equal their run alone ({rate:.1%}) over {trials} schedules")
    assert rate >= floor, f"{quantization}: only {rate:.1%} of rows equal their run alone"
