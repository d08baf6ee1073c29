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
from tests.support.invariance import NEIGHBOURS, layouts_that_differ, unlike_alone
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_kernel_sums_a_row_alike_wherever_its_slot_starts_on_the_grain(
    dtype: torch.dtype,
) -> None:
    """The pool step's batch invariance on CUDA rests on its attention kernel reading keys in blocks
    counted from the extent's start, no larger than the grain (workers/engine/pool_step.py's
    KERNEL_BLOCK): one row's attention, bit for bit, wherever its slot starts on the grain."""
    assert layouts_that_differ("cuda", dtype) == []


@pytest.mark.parametrize("quantization", ["bf16", "nf4"])
def test_in_half_precision_a_pool_row_is_the_same_wherever_its_neighbours_put_it(quantization: str) -> None:
    """A row decoded by the pool step beside neighbours that put its slot elsewhere writes the keys and
    values it writes alone, every layer, bit for bit, and picks the same tokens."""
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization=quantization, device="cuda"))
    backend.load()
    for before in NEIGHBOURS:
        assert unlike_alone(backend, before) == [], before


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_a_later_prefill_chunk_takes_the_bottom_right_causal_kernel_on_cuda(
    dtype: torch.dtype, tolerance: float
) -> None:
    """row_attention.suffix_attention on CUDA: the chunk's mask is the kernel's own (no mask made, no math
    kernel), and it gives the explicit mask's attention."""
    from torch.profiler import ProfilerActivity, profile

    from workers.backends.attention import kernel_from_ops
    from workers.engine.row_attention import suffix_attention

    noise = torch.Generator(device="cuda").manual_seed(5)
    start, stop, heads, dim = 1536, 2048, 8, 64
    query = torch.randn(1, heads, stop - start, dim, device="cuda", generator=noise, dtype=dtype)
    key, value = (torch.randn(1, heads, stop, dim, device="cuda", generator=noise, dtype=dtype) for _ in "kv")
    with profile(activities=[ProfilerActivity.CPU]) as traced:
        out = suffix_attention(query, key, value, start, None)
    ran = {event.name for event in traced.events()}
    assert ran & {"aten::_scaled_dot_product_flash_attention", "aten::_efficient_attention_forward"}, ran
    assert kernel_from_ops(ran) != "math"
    columns, rows = torch.arange(stop, device="cuda"), torch.arange(start, stop, device="cuda")
    seen = columns.unsqueeze(0) <= rows.unsqueeze(1)
    scores = (query.double() @ key.double().transpose(-1, -2)) * dim**-0.5
    expected = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ value.double()).transpose(1, 2)
    assert torch.allclose(out.double(), expected, atol=tolerance)
