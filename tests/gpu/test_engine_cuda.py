"""The engine's oracle on CUDA: a row beside others, joining at any step, against the same row alone.
Skipped where no GPU is present. bf16 and NF4 kernels may pick different reduction orders for
different batch shapes, so agreement is measured and reported, and held to a floor, not assumed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shared.settings import Settings
from tests.support.engine_runs import engine_tokens, random_items
from workers.backends.fuyu import FuyuBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
PROMPTS = ["Refund?", "Is the parcel damaged at all, or only the box?", "What is written on the label?"]


@pytest.mark.parametrize(("quantization", "floor"), [("fp32", 1.0), ("bf16", 0.9), ("nf4", 0.9)])
def test_rows_agree_with_the_same_row_alone_on_cuda(quantization: str, floor: float) -> None:
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization=quantization, device="cuda"))
    backend.load()
    rng = random.Random(3)
    agree = total = 0
    trials = 20
    for _ in range(trials):
        items = random_items(rng, PROMPTS)
        together = engine_tokens(backend, items, [rng.randint(0, 8) for _ in items])
        for item, row in zip(items, together, strict=True):
            total += 1
            agree += row == engine_tokens(backend, [item], [0])[0]
    rate = agree / total
    print(f"{quantization}: {agree}/{total} rows equal their run alone ({rate:.1%}) over {trials} schedules")
    assert rate >= floor, f"{quantization}: only {rate:.1%} of rows equal their run alone"


@pytest.mark.parametrize("decode", ["fixed", "pool"])
def test_captured_steps_give_the_eager_steps_tokens(decode: str) -> None:
    """The fixed-shape steps (the slots of the longest job; slots by need over the pool) replayed as
    CUDA graphs pick what the same steps run eagerly pick, and what the rows step picks (fp32: the
    same kernels, whatever the schedule)."""
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cuda"))
    backend.load()
    rng = random.Random(5)
    for _ in range(4):
        items = random_items(rng, PROMPTS)
        arrivals = [rng.randint(0, 8) for _ in items]
        eager = engine_tokens(backend, items, arrivals, decode=decode)
        assert engine_tokens(backend, items, arrivals, decode=decode, capture=True) == eager
        assert engine_tokens(backend, items, arrivals, decode="rows") == eager
