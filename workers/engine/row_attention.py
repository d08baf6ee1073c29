"""Attention over each row's own length, for the decode step that runs rows as they are (the CPU's).

A decode step's query is one position per row. Here each row attends to a view of its own slot,
`keys[slot, :, :length]`, through the attention function the model was configured with: no padding is
read (a short row never pays a long neighbour's width) and nothing is copied or gathered. Rows whose
slots are adjacent and whose lengths are equal share one call.
transformers looks the attention function up by name at every call (`config._attn_implementation`), so
`per_row` switches the language model to this one for the length of one step, and back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.persimmon.modeling_persimmon import eager_attention_forward

NAME = "mrc_rows"
_step = threading.local()  # the step's (slot, length) per batch row; only the engine's thread sets it


def _runs(pairs: list[tuple[int, int]]) -> Iterator[tuple[int, int, int, int]]:
    """(first batch row, rows, first slot, length) of each run of rows in adjacent slots and of one length."""
    start = 0
    for index in range(1, len(pairs) + 1):
        slot, length = pairs[start]
        if index == len(pairs) or pairs[index] != (slot + index - start, length):
            yield start, index - start, slot, length
            start = index


def attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [rows, heads, 1, head_dim]; key and value: the layer's whole slot buffers. Each run of rows
    goes through the attention the model was configured with (MRC_ATTENTION), over its own views."""
    inner = _step.inner
    outputs = [
        inner(
            module,
            query[first : first + rows],
            key[slot : slot + rows, :, :length],
            value[slot : slot + rows, :, :length],
            None,
            scaling=scaling,
            dropout=dropout,
        )[0]
        for first, rows, slot, length in _runs(_step.pairs)
    ]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), None


AttentionInterface.register(NAME, attention)


@contextlib.contextmanager
def per_row(config: Any, pairs: list[tuple[int, int]]) -> Iterator[None]:
    """For one call of the language model: each batch row attends to (its slot, its length)."""
    before = config._attn_implementation
    config._attn_implementation = NAME
    _step.pairs, _step.inner = pairs, ALL_ATTENTION_FUNCTIONS.get_interface(before, eager_attention_forward)
    try:
        yield
    finally:
        config._attn_implementation, _step.pairs, _step.inner = before, None, None
