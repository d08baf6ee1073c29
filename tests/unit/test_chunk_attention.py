"""A prefill chunk's attention without a mask (workers/engine/row_attention.py `suffix_attention`): a
chunk of positions start..stop over its slot's 0..stop, each position seeing itself and what comes
before. Every way it is computed (SDPA's causal flag for a first chunk, the CPU's two flash calls merged
by their log-sum-exps, CUDA's bottom-right causal kernel, run here through PyTorch's own fallback) gives
what the explicit mask gives; and a model prefilled in chunks through SDPA (no mask) and through the
eager attention (a mask) writes the keys a whole prefill writes."""

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
def test_cudas_bottom_right_kernel_and_the_cpus_merge_put_the_mask_alike(start: int, stop: int) -> None:
    """The CUDA branch's semantics checked on the CPU (PyTorch makes the bottom-right mask there): the
    chunk's last query sees every key, its first sees `start + 1`; top-left alignment would fail."""
    query, key, value = _inputs(start, stop, torch.float32)
    expected = _reference(query, key, value, start).transpose(1, 2)
    right = row_attention.lower_right_attention(query, key, value, None)
    merged = row_attention.merged_attention(query, key, value, start, None)
    assert torch.allclose(right.double(), expected, atol=1e-5)
    assert torch.allclose(merged.double(), expected, atol=1e-5)
    top_left = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    assert not torch.allclose(top_left.double(), expected, atol=1e-3)


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
