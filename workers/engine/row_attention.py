"""Attention over each row's own length: for the decode step that runs rows as they are (the CPU's),
and for a step's prefill chunks, every row's in one call (`per_chunk`).

A decode step's query is one position per row. Here each row attends to a view of its own slot,
`keys[:, start:start + length]` of the layer's pool, through the attention function the model was
configured with: no padding is read (a short row never pays a long neighbour's width) and nothing is
copied or gathered. Rows of one length whose slots follow each other at one stride (rows of one mix,
admitted together) share one call, over a strided view of all of them.
A prefill call's query is the positions of several rows' chunks laid end to end (one sequence: the
model's linear layers run once for them all); each chunk attends to its own slot up to its own end,
causally, through a view of the slot and a mask made once per call for every layer. On CUDA with
SDPA (the default there) no mask is made: a mask makes the kernels compute every query against every
key and read the mask, where the bottom-right causal kernels skip the keys after each query
(`suffix_attention`). The CPU keeps the mask: its SDPA has no such kernel, and the mask is what keeps
a prefix hit's positions bit for bit those of the same prompt computed without the hit in half
precision (the same keys in the same kernel blocks, whatever the chunk's start).
transformers looks the attention function up by name at every call (`config._attn_implementation`), so
`per_row` and `per_chunk` switch the language model to theirs for the length of one call, and back
(an attention name transformers has no mask function for: it makes no mask of its own).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.persimmon.modeling_persimmon import eager_attention_forward

NAME, CHUNKS = "mrc_rows", "mrc_chunks"
# The call's (slot start, length) per batch row, or its chunks; only the engine's thread sets it.
_step = threading.local()


def _runs(pairs: list[tuple[int, int]]) -> Iterator[tuple[int, int, int, int, int]]:
    """(first batch row, rows, first slot's start, stride between slots, length) of each run of rows of
    one length whose slots start at one stride (at least their length: slots never overlap)."""
    first = 0
    while first < len(pairs):
        start, length = pairs[first]
        stride = pairs[first + 1][0] - start if first + 1 < len(pairs) else length
        end = first + 1
        if stride >= length:
            while end < len(pairs) and pairs[end] == (start + (end - first) * stride, length):
                end += 1
        yield first, end - first, start, stride if end - first > 1 else length, length
        first = end


def _rows_view(pool: torch.Tensor, rows: int, start: int, stride: int, length: int) -> torch.Tensor:
    """[rows, heads, length, head_dim]: `rows` slots of the pool ([heads, pool, head_dim]) from `start`,
    `stride` positions apart, as one view."""
    heads, _, dim = pool.shape
    strides = (stride * pool.stride(1), pool.stride(0), pool.stride(1), pool.stride(2))
    offset = pool.storage_offset() + start * pool.stride(1)
    return pool.as_strided((rows, heads, length, dim), strides, offset)


def attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [rows, heads, 1, head_dim]; key and value: the layer's whole pool [heads, pool, head_dim].
    Each run of rows goes through the attention the model was configured with (MRC_ATTENTION), over its
    own views."""
    inner = _step.inner
    outputs = [
        inner(
            module,
            query[first : first + rows],
            _rows_view(key, rows, start, stride, length),
            _rows_view(value, rows, start, stride, length),
            None,
            scaling=scaling,
            dropout=dropout,
        )[0]
        for first, rows, start, stride, length in _runs(_step.pairs)
    ]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), None


def chunk_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [1, heads, every chunk's positions, head_dim]; key and value: the layer's whole pool. Each
    chunk's queries attend to its own slot's first `stop` positions (its chunk just written in place)."""
    inner, masks = _step.inner, _step.masks
    direct = masks is None and getattr(module, "num_key_value_groups", 1) == 1
    outputs = []
    for index, (offset, count, base, start, stop) in enumerate(_step.chunks):
        own = query[:, :, offset : offset + count]
        keys, values = key[:, base : base + stop].unsqueeze(0), value[:, base : base + stop].unsqueeze(0)
        if direct:
            outputs.append(suffix_attention(own, keys, values, start, scaling))
        else:
            mask = masks[index] if masks is not None else causal(start, stop, query.dtype, query.device)
            outputs.append(inner(module, own, keys, values, mask, scaling=scaling, dropout=dropout)[0])
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def suffix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, scale: float | None
) -> torch.Tensor:
    """A chunk's positions start..stop ([1, heads, stop - start, dim]) over its slot's 0..stop, each
    seeing itself and what comes before, as [1, stop - start, heads, dim] (what transformers' attention
    functions return). SDPA's own causal flag aligns the top left corners, right only for a chunk that
    starts its slot; later chunks take the bottom-right causal kernel (flash or memory-efficient on
    CUDA; elsewhere PyTorch makes the mask)."""
    count = query.shape[2]
    if count == 0:  # nothing to attend (a kernel may fault on it rather than raise)
        return query.new_empty(1, 0, query.shape[1], value.shape[-1])
    if count == 1 or start == 0:  # one position sees every key; a first chunk is square
        out = F.scaled_dot_product_attention(query, key, value, is_causal=count > 1, scale=scale)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(count, key.shape[2]), scale=scale
        )
    return out.transpose(1, 2).contiguous()


def causal(start: int, stop: int, dtype: Any, device: Any) -> torch.Tensor | None:
    """The mask of a chunk of positions start..stop over its slot's 0..stop: each sees itself and what
    comes before ([1, 1, stop - start, stop]); None for one position, which sees everything."""
    if stop - start == 1:
        return None
    columns = torch.arange(stop, device=device)
    rows = torch.arange(start, stop, device=device)
    mask = torch.where(columns.unsqueeze(0) <= rows.unsqueeze(1), 0.0, torch.finfo(dtype).min).to(dtype)
    return mask.view(1, 1, stop - start, stop)


AttentionInterface.register(NAME, attention)
AttentionInterface.register(CHUNKS, chunk_attention)


@contextlib.contextmanager
def per_row(config: Any, pairs: list[tuple[int, int]]) -> Iterator[None]:
    """For one call of the language model: each batch row attends to (its slot's start, its length)."""
    with _switched(config, NAME):
        _step.pairs = pairs
        yield


@contextlib.contextmanager
def per_chunk(
    config: Any, chunks: list[tuple[int, int, int, int, int]], dtype: Any, device: Any
) -> Iterator[None]:
    """For one prefill call: (first query position, positions, slot's start, chunk's start in the slot,
    its stop) of each row's chunk, in the order the call lays them end to end."""
    # CUDA's SDPA chunks need none (suffix_attention); the CPU keeps it (the module's docstring says why)
    masked = config._attn_implementation != "sdpa" or torch.device(device).type != "cuda"
    with _switched(config, CHUNKS):
        _step.chunks = chunks
        _step.masks = [causal(start, stop, dtype, device) for *_, start, stop in chunks] if masked else None
        yield


@contextlib.contextmanager
def _switched(config: Any, name: str) -> Iterator[None]:
    before = config._attn_implementation
    config._attn_implementation = name
    _step.inner = ALL_ATTENTION_FUNCTIONS.get_interface(before, eager_attention_forward)
    try:
        yield
    finally:
        config._attn_implementation, _step.inner, _step.pairs = before, None, None
        _step.chunks = _step.masks = None
