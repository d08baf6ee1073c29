"""A prefill chunk's attention without a mask (workers/engine/row_attention.py `suffix_attention`, CUDA's
way): a chunk of positions start..stop over its slot's 0..stop, each position seeing itself and what
comes before. Every way it is computed (SDPA's causal flag for a first chunk, the bottom-right causal
kernel for a later one: run here through PyTorch's own fallback, on CUDA by tests/gpu) gives what the
explicit mask gives. The CPU's chunks keep the mask: a model prefilled in chunks through SDPA and
through the eager attention writes the keys a whole prefill writes, and a prefix hit's positions are
bit for bit those of the same prompt without the hit, in half precision too."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch

from shared.settings import Settings
from workers.backends.fuyu import FuyuBackend
from workers.engine import row_attention

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
# (start, stop): a first chunk, one position alone, a chunk after 512 keys, a chunk of 2 after one, one
# after a part block, a long chunk after a short prefix
CHUNKS = [(0, 64), (0, 1), (300, 301), (512, 1024), (1, 3), (97, 160), (17, 700)]


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int) -> torch.Tensor:
    """The explicit mask in fp64: position start + i sees keys 0..start + i."""
    count, stop = query.shape[2], key.shape[2]
    seen = torch.arange(stop).unsqueeze(0) <= torch.arange(start, stop).unsqueeze(1)
    q, k, v = (t.double() for t in (query, key, value))
    scores = (q @ k.transpose(-1, -2)) * float(query.shape[-1]) ** -0.5
    out: torch.Tensor = scores.masked_fill(~seen.view(1, 1, count, stop), float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2)


def _inputs(start: int, stop: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    noise = torch.Generator().manual_seed(start * 7919 + stop)
    heads, dim = 4, 64
    query = torch.randn(1, heads, stop - start, dim, generator=noise).to(dtype)
    key = torch.randn(1, heads, stop, dim, generator=noise).to(dtype) * 2  # scores spread, not uniform
    return query, key, torch.randn(1, heads, stop, dim, generator=noise).to(dtype)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("start", "stop"), CHUNKS)
def test_a_chunk_without_a_mask_equals_the_masked_attention(
    start: int, stop: int, dtype: torch.dtype, tolerance: float
) -> None:
    query, key, value = _inputs(start, stop, dtype)
    out = row_attention.suffix_attention(query, key, value, start, None)
    assert out.shape == (1, stop - start, 4, 64)
    assert out.dtype == dtype
    assert out.is_contiguous()
    assert torch.allclose(out.double(), _reference(query, key, value, start), atol=tolerance)


def test_a_chunk_of_no_positions_attends_to_nothing() -> None:
    query, key, value = _inputs(10, 10, torch.float32)
    assert row_attention.suffix_attention(query, key, value, 10, None).shape == (1, 0, 4, 64)


@pytest.mark.parametrize(("start", "stop"), [c for c in CHUNKS if c[0] > 0 and c[1] - c[0] > 1])
def test_a_later_chunk_puts_the_causal_corner_at_the_bottom_right(start: int, stop: int) -> None:
    """The chunk's last query sees every key, its first `start + 1`; SDPA's own causal flag (top left)
    would be wrong."""
    query, key, value = _inputs(start, stop, torch.float32)
    expected = _reference(query, key, value, start)
    assert torch.allclose(
        row_attention.suffix_attention(query, key, value, start, None).double(), expected, atol=1e-5
    )
    top_left = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    assert not torch.allclose(top_left.transpose(1, 2).double(), expected, atol=1e-3)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_prompt_prefilled_in_chunks_writes_the_keys_of_one_whole_call(
    implementation: Literal["sdpa", "eager"],
) -> None:
    backend = FuyuBackend(
        Settings(model="tiny", home=HOME, quantization="fp32", device="cpu", attention=implementation)
    )
    backend.load()
    ids = torch.randint(3, int(backend.model.config.text_config.vocab_size), (1, 700))
    inputs, length = {"input_ids": ids}, 700
    first, cache, _ = backend.step_model(2, length + 8).prefill([inputs])
    chunked = backend.step_model(2, length + 8)
    chunked.begin("a", inputs, length)
    tokens = [chunked.extend([("a", stop)])[0] for stop in (1, 3, 160, 512, 699, 700)]
    assert tokens[:-1] == [None] * 5
    assert tokens[-1] == first[0]
    start = chunked.table.start("a")
    for (keys, values), layer in zip(chunked.cache.read(start, length), cache.layers, strict=True):
        assert torch.allclose(keys, layer.keys[0], atol=1e-4)
        assert torch.allclose(values, layer.values[0], atol=1e-4)


def test_on_the_cpu_a_prefix_hits_positions_are_those_of_the_prompt_without_it_bit_for_bit() -> None:
    """bf16: the question's positions after its photo's hit (a chunk starting mid-prompt) write the keys
    and values the same prompt's last chunk writes without the hit. A chunk attention split at the
    chunk's start (tried: two flash calls merged) rounds otherwise and changed NF4 answers with reuse
    on against off."""
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization="bf16", device="cpu"))
    backend.load()
    ids = torch.randint(3, int(backend.model.config.text_config.vocab_size), (1, 400))
    inputs, length = {"input_ids": ids}, 400
    for hit in (16, 160, 384):
        runner = backend.step_model(3, length + 8)
        runner.begin("whole", inputs, length)
        runner.extend([("whole", length)])
        runner.begin("tail", inputs, length)
        runner.cache.move(runner.table.start("whole"), runner.table.start("tail"), hit)  # the hit's copy
        runner.table.set_length("tail", hit)
        runner.extend([("tail", length)])
        whole, tail = runner.table.start("whole"), runner.table.start("tail")
        for (keys, values), (tail_keys, tail_values) in zip(
            runner.cache.read(whole, length), runner.cache.read(tail, length), strict=True
        ):
            assert torch.equal(keys[:, hit:], tail_keys[:, hit:]), hit
            assert torch.equal(values[:, hit:], tail_values[:, hit:]), hit


@pytest.mark.parametrize("size", [(480, 640), (700, 600), (768, 1024)])
def test_on_the_cpu_a_second_question_about_a_photo_computes_what_it_would_alone(
    size: tuple[int, int],
) -> None:
    """bf16, through the hit's own path (the prefix index, its copy, the patches past it projected): the
    positions a photo's second question computes are bit for bit those it computes with no hit."""
    from workers.backends.base import GenerationInput

    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization="bf16", device="cpu"))
    backend.load()
    image = torch.randint(
        0, 256, (3, *size), dtype=torch.uint8, generator=torch.Generator().manual_seed(size[0])
    )
    first, second = (
        backend.prepare([GenerationInput(image, prompt, 4)]).inputs
        for prompt in ("What colour is the parcel?", "Is the parcel damaged?")
    )
    lengths = int(first["input_ids"].shape[1]), int(second["input_ids"].shape[1])
    runners = [backend.step_model(3, max(lengths) + 8) for _ in range(2)]
    runners[0].begin("first", first, lengths[0], identity=("key", "photo"))
    runners[0].extend([("first", lengths[0])])
    runners[0].table.retain("first")
    reused = runners[0].begin("second", second, lengths[1], identity=("key", "photo"))
    assert reused > 0
    runners[1].begin("second", second, lengths[1])
    for runner in runners:
        runner.extend([("second", lengths[1])])
    with_hit, alone = (r.cache.read(r.table.start("second"), lengths[1]) for r in runners)
    for (keys, values), (alone_keys, alone_values) in zip(with_hit, alone, strict=True):
        assert torch.equal(keys[:, reused:], alone_keys[:, reused:])
        assert torch.equal(values[:, reused:], alone_values[:, reused:])
